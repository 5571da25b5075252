output "label_keys" {
  description = "The moshray label keys (cluster, role, pool, market)."
  value       = local.label_keys
}

output "common_labels" {
  description = "Labels every labelled resource of the cluster carries."
  value       = local.common_labels
}

output "head_labels" {
  description = "Labels of the head VM."
  value       = local.head_labels
}

output "worker_labels" {
  description = "Labels of spot worker VMs (the NodeProvider adds the pool)."
  value       = local.worker_labels
}

output "provider_module" {
  description = "Module path of the NodeProvider in Ray's autoscaler config."
  value       = local.provider_module
}

output "vm_name_prefix" {
  description = "Name prefix of the VMs the NodeProvider creates."
  value       = local.vm_name_prefix
}

output "worker_metadata" {
  description = "Metadata of worker VMs (startup script, OS Login)."
  value       = local.worker_metadata
}

output "autoscaler_config" {
  description = "Ray's autoscaler config as YAML."
  value       = yamlencode(local.autoscaler_config)
}

output "head_startup_script" {
  description = "Startup script of the head VM."
  value       = local.head_startup_script
}

output "worker_startup_script" {
  description = "Startup script of spot worker VMs."
  value       = local.worker_startup_script
}
