# A moshray node VM image (AWS AMI or GCE image) for the Terraform in infra/aws, infra/gcp:
# /opt/moshray holds Ray, torch and the moshray wheel of this checkout at the versions infra/
# pins, so the nodes' startup script (modules/bootstrap install.sh.tftpl) finds them with
# check_node.py and skips its downloads. Build from the repository root (README.md here):
#
#   packer init infra/images/node.pkr.hcl
#   packer build -only='amazon-ebs.node' -var moshray_wheel=dist/moshray-<version>-py3-none-any.whl \
#     -var aws_source_ami=ami-... infra/images/node.pkr.hcl
#
# ray_version / torch_version must equal the Terraform variables of the same names.

packer {
  required_plugins {
    amazon = {
      source  = "github.com/hashicorp/amazon"
      version = ">= 1.3.0"
    }
    googlecompute = {
      source  = "github.com/hashicorp/googlecompute"
      version = ">= 1.1.0"
    }
  }
}

variable "moshray_wheel" {
  type        = string
  description = "Path of the wheel built from the checkout (python -m pip wheel --no-deps -w dist .)."
}

variable "ray_version" {
  type        = string
  default     = "2.60.0"
  description = "Ray version installed (ray[default,train]==this); equal to infra's ray_version."
}

variable "torch_version" {
  type        = string
  default     = "2.13.0"
  description = "torch version installed (torch==this); equal to infra's torch_version."
}

variable "aws_region" {
  type    = string
  default = "us-east-1"
}

variable "aws_source_ami" {
  type        = string
  default     = ""
  description = "AMI to start from, e.g. the Deep Learning Base AMI (Ubuntu 22.04) of the region (NVIDIA driver included)."
}

variable "gcp_project_id" {
  type    = string
  default = ""
}

variable "gcp_zone" {
  type    = string
  default = "us-central1-a"
}

variable "gcp_source_image_family" {
  type    = string
  default = "common-cu124-ubuntu-2204-py310"
}

locals {
  # Docker-style tags and image names allow no "+": 0.1.1.dev5+g1a2b3c4 -> 0-1-1-dev5-g1a2b3c4.
  wheel_version = regex("moshray-([^-/]+)-py3-none-any[.]whl$", var.moshray_wheel)[0]
  image_name    = "moshray-node-${lower(replace(local.wheel_version, "/[^0-9A-Za-z]/", "-"))}"
}

source "amazon-ebs" "node" {
  region        = var.aws_region
  source_ami    = var.aws_source_ami
  instance_type = "m5.large"
  ssh_username  = "ubuntu"
  ami_name      = local.image_name
  tags = {
    "moshray-version" = local.wheel_version
  }
}

source "googlecompute" "node" {
  project_id              = var.gcp_project_id
  zone                    = var.gcp_zone
  source_image_family     = var.gcp_source_image_family
  source_image_project_id = ["deeplearning-platform-release"]
  machine_type            = "n2-standard-4"
  ssh_username            = "ubuntu"
  image_name              = local.image_name
  image_labels = {
    "moshray-version" = lower(replace(local.wheel_version, "/[^0-9A-Za-z_-]/", "-"))
  }
}

build {
  sources = ["source.amazon-ebs.node", "source.googlecompute.node"]

  provisioner "file" {
    sources     = [var.moshray_wheel, "infra/images/check_node.py"]
    destination = "/tmp/"
  }

  # The same install as the startup script's fallback, once, into the image.
  provisioner "shell" {
    inline = [
      "set -eu",
      "sudo apt-get update -y",
      "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv python3-pip",
      "sudo python3 -m venv /opt/moshray",
      "sudo /opt/moshray/bin/pip install --upgrade pip",
      "sudo /opt/moshray/bin/pip install /tmp/${basename(var.moshray_wheel)} 'ray[default,train]==${var.ray_version}' 'torch==${var.torch_version}'",
      "python3 /tmp/check_node.py --python /opt/moshray/bin/python --ray ${var.ray_version} --torch ${var.torch_version} --wheel ${basename(var.moshray_wheel)}",
    ]
  }
}
