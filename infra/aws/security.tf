# Two security groups. "cluster" (head and workers): Ray's ports, which Ray picks at random
# above the fixed ones, are open only to members of the same group. "admin" (head only): SSH,
# the Ray dashboard / job API and Prometheus, each only from var.admin_cidrs.

resource "aws_security_group" "cluster" {
  name        = "${var.name}-cluster"
  description = "moshray ${var.name}: Ray traffic between cluster nodes only"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-cluster" })
}

resource "aws_vpc_security_group_ingress_rule" "cluster_internal" {
  security_group_id            = aws_security_group.cluster.id
  description                  = "Ray (GCS, raylets, object store, workers) between cluster nodes"
  ip_protocol                  = "-1"
  referenced_security_group_id = aws_security_group.cluster.id
  tags                         = local.tags
}

resource "aws_vpc_security_group_egress_rule" "cluster_out" {
  security_group_id = aws_security_group.cluster.id
  description       = "Outbound: package installs, AWS APIs, checkpoints"
  ip_protocol       = "-1"
  cidr_ipv4         = "0.0.0.0/0"
  tags              = local.tags
}

resource "aws_security_group" "admin" {
  name        = "${var.name}-admin"
  description = "moshray ${var.name}: SSH, Ray dashboard / job API and Prometheus from admin CIDRs"
  vpc_id      = local.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-admin" })
}

locals {
  admin_ports = {
    ssh        = 22
    dashboard  = local.dashboard_port
    prometheus = local.prometheus_port
  }
  admin_rules = {
    for pair in setproduct(keys(local.admin_ports), var.admin_cidrs) :
    "${pair[0]}-${pair[1]}" => { port = local.admin_ports[pair[0]], cidr = pair[1], what = pair[0] }
  }
}

resource "aws_vpc_security_group_ingress_rule" "admin" {
  for_each          = local.admin_rules
  security_group_id = aws_security_group.admin.id
  description       = "${each.value.what} from an admin CIDR"
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
  cidr_ipv4         = each.value.cidr
  tags              = local.tags
}
