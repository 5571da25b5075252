# A VPC network with one regional subnetwork, which serves every zone of the region (the
# worker pools span several zones), or an existing network and subnetwork. VMs get external
# addresses for package installs; the firewall admits nothing from outside but the admin
# CIDRs.

locals {
  create_network = var.existing_network == null
  network        = local.create_network ? google_compute_network.this[0].self_link : var.existing_network
  subnetwork     = local.create_network ? google_compute_subnetwork.this[0].self_link : var.existing_subnetwork
}

resource "google_compute_network" "this" {
  count                   = local.create_network ? 1 : 0
  project                 = var.project_id
  name                    = var.name
  auto_create_subnetworks = false

  depends_on = [google_project_service.apis]
}

resource "google_compute_subnetwork" "this" {
  count                    = local.create_network ? 1 : 0
  project                  = var.project_id
  name                     = "${var.name}-${var.region}"
  region                   = var.region
  network                  = google_compute_network.this[0].id
  ip_cidr_range            = var.subnet_cidr
  private_ip_google_access = true
}
