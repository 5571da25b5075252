output "head_address" {
  description = "Public IPv4 address of the head node (SSH as ubuntu)."
  value       = aws_eip.head.public_ip
}

output "head_private_ip" {
  description = "Private IPv4 address of the head node; workers join Ray at port 6379 there."
  value       = aws_network_interface.head.private_ip
}

output "ray_job_submit_address" {
  description = "Address for `ray job submit --address` (RAY_ADDRESS) and the Ray dashboard."
  value       = "http://${aws_eip.head.public_ip}:${local.dashboard_port}"
}

output "prometheus_url" {
  description = "Prometheus on the head node (reachable from admin_cidrs only)."
  value       = "http://${aws_eip.head.public_ip}:${local.prometheus_port}"
}

output "fetch_token_command" {
  description = "Shell command that prints the Ray auth token (needs secretsmanager:GetSecretValue on the secret)."
  value       = "aws secretsmanager get-secret-value --region ${var.region} --secret-id ${aws_secretsmanager_secret.ray_token.arn} --query SecretString --output text"
}

output "token_secret_arn" {
  description = "ARN of the Secrets Manager secret holding the Ray auth token (the ARN, not the token)."
  value       = aws_secretsmanager_secret.ray_token.arn
}

output "worker_launch_template_id" {
  description = "Spot worker launch template the NodeProvider launches from."
  value       = aws_launch_template.worker.id
}

output "autoscaler_config" {
  description = "Ray autoscaler config installed on the head at /etc/moshray/autoscaler.yaml."
  value       = module.bootstrap.autoscaler_config
}

output "bucket" {
  description = "S3 bucket of the cluster (checkpoints, data, expert snapshots under storage_prefix; the wheel under wheels/)."
  value       = local.bucket
}

output "checkpoint_uri" {
  description = "checkpoint.uri for the job (--checkpoint or jobs/configs/aws.toml): head and workers may read and write there."
  value       = local.checkpoint_uri
}

output "wheel_uri" {
  description = "The moshray wheel every node installs (uploaded from moshray_wheel_path)."
  value       = "s3://${local.bucket}/${aws_s3_object.wheel.key}"
}

output "head_instance_profile_arn" {
  description = "Instance profile of the head (Ray autoscaler: launch / terminate cluster workers, pass the worker role; the bucket)."
  value       = aws_iam_instance_profile.head.arn
}

output "worker_instance_profile_arn" {
  description = "Instance profile of spot workers (the token secret; the bucket)."
  value       = aws_iam_instance_profile.worker.arn
}
