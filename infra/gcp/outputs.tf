output "head_address" {
  description = "External IPv4 address of the head VM (SSH through OS Login)."
  value       = google_compute_address.head_external.address
}

output "head_private_ip" {
  description = "Internal IPv4 address of the head VM; workers join Ray at port 6379 there."
  value       = google_compute_address.head_internal.address
}

output "ray_job_submit_address" {
  description = "Address for `ray job submit --address` (RAY_ADDRESS) and the Ray dashboard."
  value       = "http://${google_compute_address.head_external.address}:${local.dashboard_port}"
}

output "prometheus_url" {
  description = "Prometheus on the head VM (reachable from admin_cidrs only)."
  value       = "http://${google_compute_address.head_external.address}:${local.prometheus_port}"
}

output "fetch_token_command" {
  description = "Shell command that prints the Ray auth token (needs secretmanager.versions.access on the secret)."
  value       = "gcloud secrets versions access latest --project ${var.project_id} --secret ${google_secret_manager_secret.ray_token.secret_id}"
}

output "token_secret" {
  description = "Secret Manager secret holding the Ray auth token (its name, not the token)."
  value       = google_secret_manager_secret.ray_token.id
}

output "worker_instance_template" {
  description = "Self link of the Spot worker instance template."
  value       = google_compute_instance_template.worker.self_link
}

output "autoscaler_config" {
  description = "Ray autoscaler config installed on the head at /etc/moshray/autoscaler.yaml."
  value       = module.bootstrap.autoscaler_config
}

output "bucket" {
  description = "GCS bucket of the cluster (checkpoints, data, expert snapshots under storage_prefix; the wheel under wheels/)."
  value       = local.bucket
}

output "checkpoint_uri" {
  description = "checkpoint.uri for the job (--checkpoint or jobs/configs/gcp.toml): head and workers may read and write there."
  value       = local.checkpoint_uri
}

output "wheel_uri" {
  description = "The moshray wheel every VM installs (uploaded from moshray_wheel_path)."
  value       = "gs://${local.bucket}/${google_storage_bucket_object.wheel.name}"
}

output "head_service_account" {
  description = "Service account of the head VM (Ray autoscaler: create / delete cluster workers, act as the worker service account; the bucket)."
  value       = google_service_account.head.email
}

output "worker_service_account" {
  description = "Service account of Spot worker VMs (the token secret; the bucket)."
  value       = google_service_account.worker.email
}
