# Two instance roles.
#
# Head (runs Ray's autoscaler with moshray's NodeProvider): launch instances only from the
# worker launch template and only with the cluster tag; tag and terminate only instances
# that carry the cluster tag (never the head); describe (EC2 allows no narrower scope for
# Describe*); pass only the worker role; read the token secret.
# Worker: read the token secret. Nothing else.
# Both: the cluster's bucket (storage.tf), list and read it, write and delete only under
# var.storage_prefix (checkpoints, data, expert snapshots); no other bucket.

data "aws_iam_policy_document" "ec2_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

locals {
  ec2_arn = "arn:${local.partition}:ec2:${var.region}:${local.account_id}"
}

data "aws_iam_policy_document" "head" {
  statement {
    sid = "Describe"
    actions = [
      "ec2:DescribeInstances",
      "ec2:DescribeInstanceStatus",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeAvailabilityZones",
      "ec2:DescribeSubnets",
      "ec2:DescribeImages",
      "ec2:DescribeLaunchTemplates",
      "ec2:DescribeLaunchTemplateVersions",
      "ec2:DescribeSpotPriceHistory",
    ]
    resources = ["*"]
  }

  statement {
    sid       = "LaunchTaggedInstancesFromTheWorkerTemplate"
    actions   = ["ec2:RunInstances"]
    resources = ["${local.ec2_arn}:instance/*"]
    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/${local.cluster_tag}"
      values   = [var.name]
    }
    condition {
      test     = "ArnEquals"
      variable = "ec2:LaunchTemplate"
      values   = [aws_launch_template.worker.arn]
    }
  }

  statement {
    sid     = "LaunchUsesTheseResources"
    actions = ["ec2:RunInstances"]
    resources = concat(
      [
        "${local.ec2_arn}:volume/*",
        "${local.ec2_arn}:network-interface/*",
        "${local.ec2_arn}:spot-instances-request/*",
        "${local.ec2_arn}:key-pair/*",
        "arn:${local.partition}:ec2:${var.region}::image/*",
        aws_launch_template.worker.arn,
        aws_security_group.cluster.arn,
      ],
      [for id in values(local.subnet_ids) : "${local.ec2_arn}:subnet/${id}"],
    )
  }

  statement {
    sid     = "TagAtLaunch"
    actions = ["ec2:CreateTags"]
    resources = [
      "${local.ec2_arn}:instance/*",
      "${local.ec2_arn}:volume/*",
      "${local.ec2_arn}:network-interface/*",
      "${local.ec2_arn}:spot-instances-request/*",
    ]
    condition {
      test     = "StringEquals"
      variable = "ec2:CreateAction"
      values   = ["RunInstances"]
    }
  }

  statement {
    sid       = "TagAndTerminateClusterInstances"
    actions   = ["ec2:CreateTags", "ec2:TerminateInstances"]
    resources = ["${local.ec2_arn}:instance/*"]
    condition {
      test     = "StringEquals"
      variable = "ec2:ResourceTag/${local.cluster_tag}"
      values   = [var.name]
    }
  }

  statement {
    sid       = "NeverTerminateTheHead"
    effect    = "Deny"
    actions   = ["ec2:TerminateInstances"]
    resources = ["${local.ec2_arn}:instance/*"]
    condition {
      test     = "StringEquals"
      variable = "ec2:ResourceTag/${local.role_tag}"
      values   = ["head"]
    }
  }

  statement {
    sid       = "NeverRetagClusterOrRoleAfterLaunch"
    effect    = "Deny"
    actions   = ["ec2:CreateTags", "ec2:DeleteTags"]
    resources = ["${local.ec2_arn}:instance/*"]
    condition {
      test     = "ForAnyValue:StringEquals"
      variable = "aws:TagKeys"
      values   = [local.cluster_tag, local.role_tag]
    }
    condition {
      test     = "StringNotEquals"
      variable = "ec2:CreateAction"
      values   = ["RunInstances"]
    }
  }

  statement {
    sid       = "PassOnlyTheWorkerRole"
    actions   = ["iam:PassRole"]
    resources = [aws_iam_role.worker.arn]
    condition {
      test     = "StringEquals"
      variable = "iam:PassedToService"
      values   = ["ec2.amazonaws.com"]
    }
  }

  statement {
    sid       = "ReadTheRayToken"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [aws_secretsmanager_secret.ray_token.arn]
  }
}

data "aws_iam_policy_document" "worker" {
  statement {
    sid       = "ReadTheRayToken"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [aws_secretsmanager_secret.ray_token.arn]
  }
}

data "aws_iam_policy_document" "storage" {
  statement {
    sid       = "ListTheClusterBucket"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [local.bucket_arn]
  }

  statement {
    sid       = "ReadTheClusterBucket"
    actions   = ["s3:GetObject"]
    resources = ["${local.bucket_arn}/*"]
  }

  statement {
    sid = "WriteOnlyUnderTheStoragePrefix"
    actions = [
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${local.bucket_arn}/${var.storage_prefix}/*"]
  }
}

resource "aws_iam_role" "head" {
  name_prefix        = "${var.name}-head-"
  description        = "moshray ${var.name} head: Ray autoscaler with the spot NodeProvider"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy" "head" {
  name   = "moshray-head"
  role   = aws_iam_role.head.id
  policy = data.aws_iam_policy_document.head.json
}

resource "aws_iam_role_policy" "head_storage" {
  name   = "moshray-storage"
  role   = aws_iam_role.head.id
  policy = data.aws_iam_policy_document.storage.json
}

resource "aws_iam_instance_profile" "head" {
  name_prefix = "${var.name}-head-"
  role        = aws_iam_role.head.name
  tags        = local.tags
}

resource "aws_iam_role" "worker" {
  name_prefix        = "${var.name}-worker-"
  description        = "moshray ${var.name} spot workers"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
  tags               = local.tags
}

resource "aws_iam_role_policy" "worker" {
  name   = "moshray-worker"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.worker.json
}

resource "aws_iam_role_policy" "worker_storage" {
  name   = "moshray-storage"
  role   = aws_iam_role.worker.id
  policy = data.aws_iam_policy_document.storage.json
}

resource "aws_iam_instance_profile" "worker" {
  name_prefix = "${var.name}-worker-"
  role        = aws_iam_role.worker.name
  tags        = local.tags
}
