output "tag_keys" {
  description = "The moshray tag keys (cluster, role, pool, market)."
  value       = local.tag_keys
}

output "common_tags" {
  description = "Tags every resource of the cluster carries."
  value       = local.common_tags
}

output "head_tags" {
  description = "Tags of the head instance."
  value       = local.head_tags
}

output "worker_tags" {
  description = "Tags of spot worker instances (the NodeProvider adds the pool)."
  value       = local.worker_tags
}

output "provider_module" {
  description = "Module path of the NodeProvider in Ray's autoscaler config."
  value       = local.provider_module
}

output "autoscaler_config" {
  description = "Ray's autoscaler config as YAML."
  value       = yamlencode(local.autoscaler_config)
}

output "head_user_data" {
  description = "Startup script of the head node."
  value       = local.head_user_data
}

output "worker_user_data" {
  description = "Startup script of spot workers."
  value       = local.worker_user_data
}
