# moshray on AWS: network, security groups, IAM, the Ray auth token secret, an on-demand
# head node and the spot worker launch template that moshray's NodeProvider launches from.
#
# The head's startup script (modules/bootstrap) starts Ray's head with token auth and the
# autoscaler config naming moshray.autoscaler.clouds.aws.provider.AWSSpotNodeProvider; the provider
# launches workers from the launch template in the pools of var.worker_pools; each worker's
# startup script joins Ray and runs `moshray watch --source aws --pool <its pool>`. Every node
# installs the same moshray wheel (built from your checkout, uploaded to the cluster's bucket
# by storage.tf) with the same pinned Ray and torch.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

data "aws_ami" "default" {
  count       = var.ami_id == null ? 1 : 0
  most_recent = true
  owners      = ["amazon"]

  filter {
    name   = "name"
    values = ["Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"]
  }
  filter {
    name   = "architecture"
    values = ["x86_64"]
  }
}

locals {
  ami_id     = var.ami_id != null ? var.ami_id : data.aws_ami.default[0].id
  account_id = data.aws_caller_identity.current.account_id
  partition  = data.aws_partition.current.partition

  ray_port        = 6379
  dashboard_port  = 8265
  prometheus_port = 9090

  tags        = merge(var.tags, module.bootstrap.common_tags)
  head_tags   = merge(local.tags, module.bootstrap.head_tags, { Name = "${var.name}-head" })
  worker_tags = merge(local.tags, module.bootstrap.worker_tags, { Name = "${var.name}-worker" })
  cluster_tag = module.bootstrap.tag_keys.cluster
  role_tag    = module.bootstrap.tag_keys.role

  pools = [for p in var.worker_pools : {
    instance_type = p.instance_type
    zone          = p.zone
    subnet_id     = local.subnet_ids[p.zone]
  }]
}

module "bootstrap" {
  source = "./modules/bootstrap"

  checkpoint_uri            = local.checkpoint_uri
  cluster_name              = var.name
  region                    = var.region
  pools                     = local.pools
  worker_launch_template_id = aws_launch_template.worker.id
  head_private_ip           = aws_network_interface.head.private_ip
  token_secret_id           = aws_secretsmanager_secret.ray_token.arn
  min_workers               = var.min_workers
  max_workers               = var.max_workers
  worker_resources          = var.worker_resources
  on_demand_max_nodes       = var.on_demand_max_nodes
  idle_timeout_minutes      = var.idle_timeout_minutes
  wheel_bucket              = local.bucket
  wheel_key                 = aws_s3_object.wheel.key
  ray_version               = var.ray_version
  torch_version             = var.torch_version
  use_internal_ips          = var.use_internal_ips
  prometheus_config         = file("${path.module}/../prometheus/prometheus.yml")
  ray_port                  = local.ray_port
  dashboard_port            = local.dashboard_port
  prometheus_port           = local.prometheus_port
}
