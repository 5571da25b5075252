# A VPC with one public subnet per zone (instances get public IPv4 addresses for package
# installs; the security groups admit nothing from outside but the admin CIDRs), or an
# existing VPC and its subnets.

locals {
  create_network = var.existing_vpc_id == null
  vpc_id         = local.create_network ? aws_vpc.this[0].id : var.existing_vpc_id
  subnet_ids = local.create_network ? {
    for zone, subnet in aws_subnet.public : zone => subnet.id
  } : var.existing_subnet_ids
  head_zone = var.worker_pools[0].zone
}

resource "aws_vpc" "this" {
  count                = local.create_network ? 1 : 0
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true
  tags                 = merge(local.tags, { Name = var.name })
}

resource "aws_internet_gateway" "this" {
  count  = local.create_network ? 1 : 0
  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = var.name })
}

resource "aws_subnet" "public" {
  for_each                = local.create_network ? toset(var.zones) : toset([])
  vpc_id                  = aws_vpc.this[0].id
  availability_zone       = each.value
  cidr_block              = cidrsubnet(var.vpc_cidr, 4, index(var.zones, each.value))
  map_public_ip_on_launch = true
  tags                    = merge(local.tags, { Name = "${var.name}-${each.value}" })
}

resource "aws_route_table" "public" {
  count  = local.create_network ? 1 : 0
  vpc_id = aws_vpc.this[0].id
  tags   = merge(local.tags, { Name = "${var.name}-public" })

  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this[0].id
  }
}

resource "aws_route_table_association" "public" {
  for_each       = aws_subnet.public
  subnet_id      = each.value.id
  route_table_id = aws_route_table.public[0].id
}
