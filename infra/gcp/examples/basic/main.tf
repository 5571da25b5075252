# The smallest root that uses the module: a head, two Spot workers (up to four), a new VPC.
#
#   (cd ../../../.. && python -m pip wheel --no-deps -w dist .)   # the wheel of this checkout
#   terraform init
#   terraform apply -var project_id=my-project -var 'admin_cidrs=["203.0.113.7/32"]' \
#     -var moshray_wheel_path=../../../../dist/moshray-0.1.0-py3-none-any.whl
#
# Then see infra/README.md for `ray job submit` and Prometheus / Grafana.

terraform {
  required_version = ">= 1.11"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.25, < 8.0"
    }
    random = {
      source  = "hashicorp/random"
      version = ">= 3.7.1, < 4.0"
    }
  }
}

variable "project_id" {
  description = "GCP project to create the cluster in."
  type        = string
}

variable "region" {
  description = "GCP region."
  type        = string
  default     = "us-central1"
}

variable "admin_cidrs" {
  description = "Your IPv4 address as a /32 (and any other admin CIDRs)."
  type        = list(string)
}

variable "moshray_wheel_path" {
  description = "The wheel built from this checkout (python -m pip wheel --no-deps -w dist . at the repository root); every node installs it."
  type        = string
}

provider "google" {
  project = var.project_id
  region  = var.region
}

module "moshray" {
  source = "../.."

  project_id  = var.project_id
  name        = "moshray-demo"
  region      = var.region
  admin_cidrs = var.admin_cidrs

  moshray_wheel_path = var.moshray_wheel_path
}

output "head_address" {
  description = "External address of the head VM."
  value       = module.moshray.head_address
}

output "ray_job_submit_address" {
  description = "RAY_ADDRESS for `ray job submit`."
  value       = module.moshray.ray_job_submit_address
}

output "prometheus_url" {
  description = "Prometheus on the head VM."
  value       = module.moshray.prometheus_url
}

output "fetch_token_command" {
  description = "Prints the Ray auth token."
  value       = module.moshray.fetch_token_command
}

output "checkpoint_uri" {
  description = "checkpoint.uri for the job (--checkpoint): the cluster's bucket."
  value       = module.moshray.checkpoint_uri
}
