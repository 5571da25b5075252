# moshray on GCP: network, firewall, service accounts, the Ray auth token secret, an
# on-demand head VM and the Spot worker VM definition that moshray's NodeProvider launches.
#
# The head's startup script (modules/bootstrap) starts Ray's head with token auth and the
# autoscaler config naming moshray.autoscaler.clouds.gcp.provider.GCPSpotNodeProvider; the provider
# inserts Spot VMs in the pools of var.worker_pools; each worker's startup script joins Ray
# and runs `moshray watch --source gcp --pool <its pool>`. Every VM installs the same moshray
# wheel (built from your checkout, uploaded to the cluster's bucket by storage.tf) with the
# same pinned Ray and torch.

locals {
  ray_port        = 6379
  dashboard_port  = 8265
  prometheus_port = 9090

  labels        = merge(var.labels, module.bootstrap.common_labels)
  head_labels   = merge(local.labels, module.bootstrap.head_labels)
  worker_labels = merge(local.labels, module.bootstrap.worker_labels)

  # Network tags: the firewall rules match them.
  cluster_network_tag = "${var.name}-node"
  head_network_tag    = "${var.name}-head"

  head_zone = var.head_zone != null ? var.head_zone : var.worker_pools[0].zone
}

resource "google_project_service" "apis" {
  for_each           = var.enable_apis ? toset(["compute.googleapis.com", "iam.googleapis.com", "secretmanager.googleapis.com", "storage.googleapis.com"]) : toset([])
  project            = var.project_id
  service            = each.value
  disable_on_destroy = false
}

module "bootstrap" {
  source = "./modules/bootstrap"

  checkpoint_uri         = local.checkpoint_uri
  cluster_name           = var.name
  project_id             = var.project_id
  pools                  = var.worker_pools
  termination_action     = var.termination_action
  head_private_ip        = google_compute_address.head_internal.address
  token_secret           = google_secret_manager_secret.ray_token.id
  subnetwork             = local.subnetwork
  network_tags           = [local.cluster_network_tag]
  worker_service_account = google_service_account.worker.email
  worker_image           = var.worker_image
  worker_disk_gb         = var.worker_disk_gb
  worker_accelerators    = var.worker_accelerators
  min_workers            = var.min_workers
  max_workers            = var.max_workers
  worker_resources       = var.worker_resources
  on_demand_max_nodes    = var.on_demand_max_nodes
  idle_timeout_minutes   = var.idle_timeout_minutes
  wheel_bucket           = local.bucket
  wheel_key              = google_storage_bucket_object.wheel.name
  ray_version            = var.ray_version
  torch_version          = var.torch_version
  use_internal_ips       = var.use_internal_ips
  prometheus_config      = file("${path.module}/../prometheus/prometheus.yml")
  ray_port               = local.ray_port
  dashboard_port         = local.dashboard_port
  prometheus_port        = local.prometheus_port
}
