# The cluster's bucket: checkpoints, data and expert snapshots under var.storage_prefix (the
# `checkpoint_uri` output), and the moshray wheel the nodes install under wheels/ (one version
# everywhere: the wheel built from your checkout, uploaded here by Terraform). Created with
# uniform bucket-level access and public access prevention, or an existing bucket
# (existing_bucket).
#
# Both service accounts may list the bucket and read every object in it (the wheel, data), and
# create, overwrite and delete objects only under var.storage_prefix (an IAM condition on the
# object name); no other bucket.

locals {
  create_bucket  = var.existing_bucket == null
  bucket         = local.create_bucket ? google_storage_bucket.this[0].name : var.existing_bucket
  checkpoint_uri = "gs://${local.bucket}/${var.storage_prefix}"
  wheel_file     = basename(var.moshray_wheel_path)
  wheel_key      = "wheels/${local.wheel_file}"
  node_members = {
    head   = "serviceAccount:${google_service_account.head.email}"
    worker = "serviceAccount:${google_service_account.worker.email}"
  }
}

resource "google_storage_bucket" "this" {
  count                       = local.create_bucket ? 1 : 0
  project                     = var.project_id
  name                        = "${var.project_id}-${var.name}"
  location                    = var.region
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = var.bucket_force_destroy
  labels                      = local.labels

  depends_on = [google_project_service.apis]
}

# The wheel built from the checkout (`python -m pip wheel --no-deps -w dist .` at the
# repository root). A new build (new content) is uploaded again; VMs created after that
# install it.
resource "google_storage_bucket_object" "wheel" {
  bucket       = local.bucket
  name         = local.wheel_key
  source       = var.moshray_wheel_path
  content_type = "application/zip"
}

resource "google_storage_bucket_iam_member" "read" {
  for_each = local.node_members
  bucket   = local.bucket
  role     = "roles/storage.objectViewer"
  member   = each.value
}

resource "google_storage_bucket_iam_member" "write_under_prefix" {
  for_each = local.node_members
  bucket   = local.bucket
  role     = "roles/storage.objectUser"
  member   = each.value

  condition {
    title       = "moshray-${var.name}-storage-prefix-only"
    description = "Objects under the cluster's storage prefix only (checkpoints, data, snapshots)."
    expression  = "resource.name.startsWith(\"projects/_/buckets/${local.bucket}/objects/${var.storage_prefix}/\")"
  }
}
