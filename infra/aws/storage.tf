# The cluster's bucket: checkpoints, data and expert snapshots under var.storage_prefix (the
# `checkpoint_uri` output), and the moshray wheel the nodes install under wheels/ (one version
# everywhere: the wheel built from your checkout, uploaded here by Terraform). Created
# private, encrypted and owner-enforced, or an existing bucket (existing_bucket).
#
# Both instance roles may list the bucket and read every object in it (the wheel, data), and
# write and delete objects only under var.storage_prefix (iam.tf, statement set "storage").

locals {
  create_bucket  = var.existing_bucket == null
  bucket         = local.create_bucket ? aws_s3_bucket.this[0].id : var.existing_bucket
  bucket_arn     = "arn:${local.partition}:s3:::${local.bucket}"
  checkpoint_uri = "s3://${local.bucket}/${var.storage_prefix}"
  wheel_file     = basename(var.moshray_wheel_path)
  wheel_key      = "wheels/${local.wheel_file}"
}

resource "aws_s3_bucket" "this" {
  count         = local.create_bucket ? 1 : 0
  bucket_prefix = "${var.name}-"
  force_destroy = var.bucket_force_destroy
  tags          = merge(local.tags, { Name = var.name })
}

resource "aws_s3_bucket_public_access_block" "this" {
  count                   = local.create_bucket ? 1 : 0
  bucket                  = aws_s3_bucket.this[0].id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "this" {
  count  = local.create_bucket ? 1 : 0
  bucket = aws_s3_bucket.this[0].id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  count  = local.create_bucket ? 1 : 0
  bucket = aws_s3_bucket.this[0].id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

# The wheel built from the checkout (`python -m pip wheel --no-deps -w dist .` at the
# repository root). A new build (new content) is uploaded again; nodes launched after that
# install it, running nodes keep theirs until they are replaced.
resource "aws_s3_object" "wheel" {
  bucket       = local.bucket
  key          = local.wheel_key
  source       = var.moshray_wheel_path
  source_hash  = filemd5(var.moshray_wheel_path)
  content_type = "application/zip"
  tags         = local.tags

  depends_on = [aws_s3_bucket_public_access_block.this]
}
