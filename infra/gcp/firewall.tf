# Ray's ports (which Ray picks at random above the fixed ones) are open only between VMs with
# the cluster's network tag. SSH, the Ray dashboard / job API and Prometheus are open on the
# head only, and only from var.admin_cidrs. A new VPC network denies all other ingress.

resource "google_compute_firewall" "internal" {
  project     = var.project_id
  name        = "${var.name}-internal"
  network     = local.network
  description = "moshray ${var.name}: Ray traffic between cluster VMs only"
  direction   = "INGRESS"
  source_tags = [local.cluster_network_tag]
  target_tags = [local.cluster_network_tag]

  allow {
    protocol = "tcp"
  }
  allow {
    protocol = "udp"
  }
  allow {
    protocol = "icmp"
  }
}

resource "google_compute_firewall" "admin" {
  project       = var.project_id
  name          = "${var.name}-admin"
  network       = local.network
  description   = "moshray ${var.name}: SSH, Ray dashboard / job API and Prometheus from admin CIDRs"
  direction     = "INGRESS"
  source_ranges = var.admin_cidrs
  target_tags   = [local.head_network_tag]

  allow {
    protocol = "tcp"
    ports    = ["22", tostring(local.dashboard_port), tostring(local.prometheus_port)]
  }
}
