# What the AWS instances run and carry, rendered from plain values.
#
# This module creates no resource and needs no provider: it turns the cluster's facts (names,
# pools, the worker launch template, the head's address, the token's secret) into the tags,
# the Ray autoscaler config and the two startup scripts. Keeping it provider-free lets
# tests/test_infra_bootstrap.py render it with Terraform itself, offline, and check the result
# against the Python package (tag names, provider module path, CLI commands).

terraform {
  required_version = ">= 1.11"
}

locals {
  # Tag keys shared with the NodeProvider and the watcher: they must equal
  # autoscaler/tags.py (CLUSTER_TAG, ROLE_TAG, POOL_TAG, MARKET_TAG).
  tag_keys = {
    cluster = "moshray-cluster"
    role    = "moshray-role"
    pool    = "moshray-pool"
    market  = "moshray-market"
  }
  # autoscaler/tags.py AWS_PROVIDER: the `provider: type: external` module of Ray's autoscaler.
  provider_module = "moshray.autoscaler.clouds.aws.provider.AWSSpotNodeProvider"
  # cluster/placement.py SPOT_RESOURCE: replicas and experts are placed only on nodes with it.
  spot_resource = "spot"

  common_tags = { (local.tag_keys.cluster) = var.cluster_name }
  head_tags = merge(local.common_tags, {
    (local.tag_keys.role)   = "head"
    (local.tag_keys.market) = "on-demand"
    # Ray's own tags: the autoscaler counts this instance as the head, not as a worker.
    "ray-node-kind"    = "head"
    "ray-cluster-name" = var.cluster_name
  })
  worker_tags = merge(local.common_tags, {
    (local.tag_keys.role)   = "worker"
    (local.tag_keys.market) = "spot"
  })

  head_node_type   = "ray.head.default"
  worker_node_type = "ray.worker.spot"
  worker_ray_resources = {
    (local.spot_resource) = 1000
  }

  # Ray's autoscaler config (the head's `ray start --autoscaling-config`). Workers start Ray
  # themselves from the launch template's user data, so no node updater (SSH) is used.
  autoscaler_config = {
    cluster_name         = var.cluster_name
    max_workers          = var.max_workers
    upscaling_speed      = 1.0
    idle_timeout_minutes = var.idle_timeout_minutes
    provider = {
      type                  = "external"
      module                = local.provider_module
      region                = var.region
      availability_zone     = var.pools[0].zone
      use_internal_ips      = var.use_internal_ips
      disable_node_updaters = true
      pools = [for p in var.pools : {
        instance_type = p.instance_type
        zone          = p.zone
        subnet_id     = p.subnet_id
      }]
      on_demand = { max_nodes = var.on_demand_max_nodes }
    }
    auth = { ssh_user = "ubuntu" }
    available_node_types = {
      (local.head_node_type) = {
        resources   = {}
        node_config = {}
        max_workers = 0
      }
      (local.worker_node_type) = {
        min_workers = var.min_workers
        max_workers = var.max_workers
        resources   = merge(var.worker_resources, local.worker_ray_resources)
        node_config = {
          LaunchTemplate = {
            LaunchTemplateId = var.worker_launch_template_id
            Version          = "$Latest"
          }
        }
      }
    }
    head_node_type                = local.head_node_type
    file_mounts                   = {}
    cluster_synced_files          = []
    rsync_exclude                 = []
    rsync_filter                  = []
    file_mounts_sync_continuously = false
    initialization_commands       = []
    setup_commands                = []
    head_setup_commands           = []
    worker_setup_commands         = []
    head_start_ray_commands       = []
    worker_start_ray_commands     = []
  }

  # One version everywhere: head and workers install the same wheel from the bucket, with
  # the same pinned Ray and torch (templates/install.sh.tftpl).
  install = templatefile("${path.module}/templates/install.sh.tftpl", {
    region        = var.region
    wheel_bucket  = var.wheel_bucket
    wheel_key     = var.wheel_key
    wheel_file    = basename(var.wheel_key)
    ray_version   = var.ray_version
    torch_version = var.torch_version
    # Skips the downloads on a node whose image holds these versions (infra/images/).
    check_node = file("${path.module}/../../../images/check_node.py")
  })

  env = {
    install         = local.install
    region          = var.region
    token_secret_id = var.token_secret_id
    head_address    = "${var.head_private_ip}:${var.ray_port}"
  }

  head_user_data = templatefile("${path.module}/templates/head.sh.tftpl", merge(local.env, {
    checkpoint_uri      = var.checkpoint_uri
    head_private_ip     = var.head_private_ip
    ray_port            = var.ray_port
    dashboard_port      = var.dashboard_port
    autoscaler_config   = yamlencode(local.autoscaler_config)
    prometheus_config   = var.prometheus_config
    prometheus_port     = var.prometheus_port
    grafana_host        = var.grafana_host
    grafana_iframe_host = var.grafana_iframe_host
  }))
  worker_user_data = templatefile("${path.module}/templates/worker.sh.tftpl", merge(local.env, {
    ray_resources_json = jsonencode(local.worker_ray_resources)
    pool_tag           = local.tag_keys.pool
  }))
}
