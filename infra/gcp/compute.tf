# The on-demand head VM and the Spot worker instance template.
#
# The head's internal address is reserved first, so that the workers' startup script can
# name it while the head's startup script names the worker definition, without a cycle.
# The NodeProvider inserts worker VMs from the same definition (module.bootstrap's
# worker node_config); the instance template holds it for `gcloud compute instances create
# --source-instance-template` and managed instance groups.

resource "google_compute_address" "head_internal" {
  project      = var.project_id
  name         = "${var.name}-head-internal"
  region       = var.region
  subnetwork   = local.subnetwork
  address_type = "INTERNAL"
}

resource "google_compute_address" "head_external" {
  project      = var.project_id
  name         = "${var.name}-head"
  region       = var.region
  address_type = "EXTERNAL"
  labels       = local.labels

  depends_on = [google_project_service.apis]
}

resource "google_compute_instance" "head" {
  project      = var.project_id
  name         = "${var.name}-head"
  zone         = local.head_zone
  machine_type = var.head_machine_type
  labels       = local.head_labels
  tags         = [local.cluster_network_tag, local.head_network_tag]

  boot_disk {
    initialize_params {
      image = var.head_image
      size  = var.head_disk_gb
      type  = "pd-balanced"
    }
  }

  network_interface {
    subnetwork = local.subnetwork
    network_ip = google_compute_address.head_internal.address
    access_config {
      nat_ip = google_compute_address.head_external.address
    }
  }

  scheduling {
    provisioning_model  = "STANDARD"
    automatic_restart   = true
    on_host_maintenance = "MIGRATE"
  }

  service_account {
    email  = google_service_account.head.email
    scopes = ["cloud-platform"]
  }

  shielded_instance_config {
    enable_secure_boot          = true
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    "startup-script"         = module.bootstrap.head_startup_script
    "enable-oslogin"         = "TRUE"
    "block-project-ssh-keys" = "TRUE"
  }

  allow_stopping_for_update = true

  depends_on = [
    google_secret_manager_secret_version.ray_token,
    google_secret_manager_secret_iam_member.readers,
    google_project_iam_member.head_launch,
    # The head installs the wheel at boot.
    google_storage_bucket_object.wheel,
    google_storage_bucket_iam_member.read,
  ]
}

resource "google_compute_instance_template" "worker" {
  project      = var.project_id
  name_prefix  = "${var.name}-worker-"
  description  = "moshray ${var.name} Spot worker (the NodeProvider sets machine type and zone per pool)"
  machine_type = var.worker_pools[0].machine_type
  region       = var.region
  labels       = local.worker_labels
  tags         = [local.cluster_network_tag]
  metadata     = module.bootstrap.worker_metadata

  disk {
    boot         = true
    auto_delete  = true
    source_image = var.worker_image
    disk_size_gb = var.worker_disk_gb
    disk_type    = "pd-balanced"
  }

  network_interface {
    subnetwork = local.subnetwork
    access_config {}
  }

  dynamic "guest_accelerator" {
    for_each = var.worker_accelerators
    content {
      type  = guest_accelerator.value.type
      count = guest_accelerator.value.count
    }
  }

  # Spot: preemptible capacity, deleted (or stopped) on preemption, never live-migrated.
  scheduling {
    provisioning_model          = "SPOT"
    preemptible                 = true
    automatic_restart           = false
    on_host_maintenance         = "TERMINATE"
    instance_termination_action = var.termination_action
  }

  service_account {
    email  = google_service_account.worker.email
    scopes = ["cloud-platform"]
  }

  shielded_instance_config {
    enable_secure_boot          = false
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  lifecycle {
    create_before_destroy = true
  }
}
