# Two service accounts.
#
# Head (runs Ray's autoscaler with moshray's NodeProvider): list and read VMs and zone
# operations in the project; create, label, delete VMs (and their boot disks) only when
# their name carries the NodeProvider's prefix "ray-<cluster>-" (an IAM condition; GCE
# labels cannot be used in conditions, names can), which the head VM itself does not have;
# use only the cluster's subnetwork; act only as the worker service account; read the token
# secret (secrets.tf).
# Worker: read the token secret. Nothing else.
# Both: the cluster's bucket (storage.tf), list and read it, write only under
# var.storage_prefix; no other bucket.

resource "google_service_account" "head" {
  project      = var.project_id
  account_id   = "${var.name}-head"
  display_name = "moshray ${var.name} head (Ray autoscaler)"

  depends_on = [google_project_service.apis]
}

resource "google_service_account" "worker" {
  project      = var.project_id
  account_id   = "${var.name}-worker"
  display_name = "moshray ${var.name} spot workers"

  depends_on = [google_project_service.apis]
}

resource "google_project_iam_custom_role" "head_read" {
  project     = var.project_id
  role_id     = replace("${var.name}_head_read", "-", "_")
  title       = "moshray ${var.name} head: read VMs"
  description = "List and read VMs and zone operations (the NodeProvider's listing)."
  permissions = [
    "compute.instances.get",
    "compute.instances.list",
    "compute.zoneOperations.get",
    "compute.zones.get",
    "compute.zones.list",
    "compute.machineTypes.get",
  ]
}

resource "google_project_iam_custom_role" "head_launch" {
  project     = var.project_id
  role_id     = replace("${var.name}_head_launch", "-", "_")
  title       = "moshray ${var.name} head: launch and delete worker VMs"
  description = "Create, label and delete VMs; bound with a condition on the NodeProvider's VM name prefix."
  permissions = [
    "compute.instances.create",
    "compute.instances.delete",
    "compute.instances.setLabels",
    "compute.instances.setMetadata",
    "compute.instances.setServiceAccount",
    "compute.instances.setTags",
    "compute.disks.create",
  ]
}

resource "google_project_iam_member" "head_read" {
  project = var.project_id
  role    = google_project_iam_custom_role.head_read.id
  member  = "serviceAccount:${google_service_account.head.email}"
}

resource "google_project_iam_member" "head_launch" {
  project = var.project_id
  role    = google_project_iam_custom_role.head_launch.id
  member  = "serviceAccount:${google_service_account.head.email}"

  condition {
    title       = "moshray-${var.name}-workers-only"
    description = "Only VMs and disks named like the NodeProvider's VMs of this cluster."
    expression  = "resource.name.extract(\"/instances/{name}\").startsWith(\"${module.bootstrap.vm_name_prefix}\") || resource.name.extract(\"/disks/{name}\").startsWith(\"${module.bootstrap.vm_name_prefix}\")"
  }
}

resource "google_compute_subnetwork_iam_member" "head_uses_subnetwork" {
  project    = var.project_id
  region     = var.region
  subnetwork = local.subnetwork
  role       = "roles/compute.networkUser"
  member     = "serviceAccount:${google_service_account.head.email}"
}

resource "google_service_account_iam_member" "head_acts_as_worker" {
  service_account_id = google_service_account.worker.name
  role               = "roles/iam.serviceAccountUser"
  member             = "serviceAccount:${google_service_account.head.email}"
}
