# The on-demand head node and the spot worker launch template.
#
# The head's private address is fixed by its own network interface, created first, so that
# the workers' startup script (in the launch template) can name it while the head's startup
# script names the launch template, without a dependency cycle.

resource "aws_network_interface" "head" {
  subnet_id       = local.subnet_ids[local.head_zone]
  security_groups = [aws_security_group.cluster.id, aws_security_group.admin.id]
  description     = "moshray ${var.name} head"
  tags            = merge(local.tags, { Name = "${var.name}-head" })
}

resource "aws_eip" "head" {
  domain            = "vpc"
  network_interface = aws_network_interface.head.id
  tags              = merge(local.tags, { Name = "${var.name}-head" })

  depends_on = [aws_internet_gateway.this]
}

resource "aws_instance" "head" {
  ami                  = local.ami_id
  instance_type        = var.head_instance_type
  iam_instance_profile = aws_iam_instance_profile.head.name
  key_name             = var.key_name
  user_data            = module.bootstrap.head_user_data
  tags                 = local.head_tags
  volume_tags          = local.tags

  primary_network_interface {
    network_interface_id = aws_network_interface.head.id
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  root_block_device {
    volume_size           = var.head_volume_gb
    volume_type           = "gp3"
    encrypted             = true
    delete_on_termination = true
  }

  lifecycle {
    # A newer AMI must not replace a running head; taint it to move on.
    ignore_changes = [ami]
  }

  # The head installs the wheel at boot, with its storage policy, and starts the autoscaler.
  depends_on = [
    aws_secretsmanager_secret_version.ray_token,
    aws_iam_role_policy.head,
    aws_iam_role_policy.head_storage,
    aws_s3_object.wheel,
  ]
}

resource "aws_launch_template" "worker" {
  name_prefix            = "${var.name}-worker-"
  description            = "moshray ${var.name} spot worker (the NodeProvider sets type, subnet and market per pool)"
  image_id               = local.ami_id
  instance_type          = var.worker_pools[0].instance_type
  key_name               = var.key_name
  vpc_security_group_ids = [aws_security_group.cluster.id]
  user_data              = base64encode(module.bootstrap.worker_user_data)
  update_default_version = true
  tags                   = local.tags

  iam_instance_profile {
    arn = aws_iam_instance_profile.worker.arn
  }

  # IMDSv2 only: the spot notice watcher and the SDKs use session tokens. Instance tags in
  # IMDS: the startup script reads the moshray-pool tag the NodeProvider set, for the
  # watcher's `--pool` (the label of its notice metrics).
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "enabled"
  }

  instance_market_options {
    market_type = "spot"
    spot_options {
      spot_instance_type             = "one-time"
      instance_interruption_behavior = "terminate"
    }
  }

  block_device_mappings {
    device_name = "/dev/sda1"
    ebs {
      volume_size           = var.worker_volume_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  tag_specifications {
    resource_type = "instance"
    tags          = local.worker_tags
  }
  tag_specifications {
    resource_type = "volume"
    tags          = local.tags
  }
}
