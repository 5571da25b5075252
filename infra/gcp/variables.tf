variable "project_id" {
  description = "GCP project that holds the cluster."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a GCP project ID (6-30 lowercase letters, digits and '-')."
  }
}

variable "name" {
  description = "Cluster name: prefix of every resource, the value of the moshray-cluster label and Ray's cluster_name."
  type        = string
  default     = "moshray"

  validation {
    # At most 30 characters: GCPSpotNodeProvider names VMs ray-<first 30 characters>-...,
    # and the head's IAM condition matches that prefix.
    condition     = can(regex("^[a-z][a-z0-9-]{1,28}[a-z0-9]$", var.name))
    error_message = "name must be 3-30 lowercase letters, digits and '-', starting with a letter."
  }
}

variable "region" {
  description = "GCP region of the cluster; the subnetwork is regional and serves every zone of it."
  type        = string
  default     = "us-central1"

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]$", var.region))
    error_message = "region must be a GCP region name such as us-central1."
  }
}

variable "admin_cidrs" {
  description = "IPv4 CIDRs allowed to reach SSH (22), the Ray dashboard / job API and Prometheus on the head. Nothing else is open to the outside; 0.0.0.0/0 only if you put it here."
  type        = list(string)

  validation {
    condition     = length(var.admin_cidrs) > 0 && alltrue([for c in var.admin_cidrs : can(cidrnetmask(c))])
    error_message = "admin_cidrs must hold at least one IPv4 CIDR such as 203.0.113.7/32."
  }
}

variable "subnet_cidr" {
  description = "CIDR of the subnetwork this module creates (ignored when existing_subnetwork is set)."
  type        = string
  default     = "10.43.0.0/20"

  validation {
    condition     = can(cidrnetmask(var.subnet_cidr))
    error_message = "subnet_cidr must be an IPv4 CIDR such as 10.43.0.0/20."
  }
}

variable "existing_network" {
  description = "Use this VPC network (self link) instead of creating one (null: create). Give existing_subnetwork with it."
  type        = string
  default     = null
}

variable "existing_subnetwork" {
  description = "Self link of a subnetwork of existing_network in var.region (with internet egress for pip installs)."
  type        = string
  default     = null

  validation {
    condition     = (var.existing_network == null) == (var.existing_subnetwork == null)
    error_message = "Set existing_network and existing_subnetwork together, or neither."
  }
}

variable "head_machine_type" {
  description = "Machine type of the on-demand head VM (Ray GCS, dashboard, autoscaler, Coordinator, Prometheus)."
  type        = string
  default     = "n2-standard-2"
}

variable "head_zone" {
  description = "Zone of the head VM (null: the zone of the first worker pool)."
  type        = string
  default     = null
}

variable "head_image" {
  description = "Boot image of the head VM."
  type        = string
  default     = "projects/ubuntu-os-cloud/global/images/family/ubuntu-2204-lts"
}

variable "head_disk_gb" {
  description = "Boot disk of the head VM in GB."
  type        = number
  default     = 100

  validation {
    condition     = var.head_disk_gb >= 30
    error_message = "head_disk_gb must be at least 30."
  }
}

variable "worker_pools" {
  description = "Spot pools the NodeProvider tries, best first: machine type x zone (zones of var.region). All types should have the shape given in worker_resources."
  type = list(object({
    machine_type = string
    zone         = string
  }))
  default = [
    { machine_type = "g2-standard-4", zone = "us-central1-a" },
    { machine_type = "g2-standard-4", zone = "us-central1-b" },
    { machine_type = "g2-standard-4", zone = "us-central1-c" },
  ]

  validation {
    condition     = length(var.worker_pools) > 0 && length(distinct(var.worker_pools)) == length(var.worker_pools)
    error_message = "worker_pools must name at least one pool and no pool twice."
  }
}

variable "worker_accelerators" {
  description = "GPUs attached to each worker VM, e.g. [{ type = \"nvidia-tesla-t4\", count = 1 }] for n1 types; none for types with built-in GPUs (g2, a2, a3)."
  type = list(object({
    type  = string
    count = number
  }))
  default = []
}

variable "worker_resources" {
  description = "Ray resources of one worker, as Ray's autoscaler plans with them (CPU, GPU); the NodeProvider adds the spot resource."
  type        = map(number)
  default     = { CPU = 4, GPU = 1 }

  validation {
    condition     = contains(keys(var.worker_resources), "CPU")
    error_message = "worker_resources must give CPU (and GPU for GPU machine types)."
  }
}

variable "worker_image" {
  description = "Boot image of worker VMs (a Deep Learning VM image with CUDA; the NVIDIA driver is installed at first boot)."
  type        = string
  default     = "projects/deeplearning-platform-release/global/images/family/common-cu124-ubuntu-2204-py310"
}

variable "worker_disk_gb" {
  description = "Boot disk of a worker VM in GB."
  type        = number
  default     = 100

  validation {
    condition     = var.worker_disk_gb >= 50
    error_message = "worker_disk_gb must be at least 50 (the Deep Learning VM image)."
  }
}

variable "termination_action" {
  description = "What GCE does to a preempted Spot VM: DELETE (default) or STOP (keeps the disk, which still costs)."
  type        = string
  default     = "DELETE"

  validation {
    condition     = contains(["DELETE", "STOP"], var.termination_action)
    error_message = "termination_action must be DELETE or STOP."
  }
}

variable "min_workers" {
  description = "Spot workers Ray's autoscaler keeps running."
  type        = number
  default     = 2

  validation {
    condition     = var.min_workers >= 0 && floor(var.min_workers) == var.min_workers
    error_message = "min_workers must be a whole number >= 0."
  }
}

variable "max_workers" {
  description = "Spot workers Ray's autoscaler may run at once."
  type        = number
  default     = 4

  validation {
    condition     = var.max_workers >= var.min_workers && var.max_workers <= 256 && floor(var.max_workers) == var.max_workers
    error_message = "max_workers must be a whole number between min_workers and 256."
  }
}

variable "on_demand_max_nodes" {
  description = "On-demand workers the NodeProvider may start when no spot pool has capacity (0: spot only)."
  type        = number
  default     = 0

  validation {
    condition     = var.on_demand_max_nodes >= 0
    error_message = "on_demand_max_nodes must be >= 0."
  }
}

variable "idle_timeout_minutes" {
  description = "Minutes an idle worker above min_workers is kept before it is deleted."
  type        = number
  default     = 5

  validation {
    condition     = var.idle_timeout_minutes >= 1
    error_message = "idle_timeout_minutes must be at least 1."
  }
}

variable "moshray_wheel_path" {
  description = "Path of the moshray wheel built from your checkout (`python -m pip wheel --no-deps -w dist .` at the repository root), e.g. ../../../../dist/moshray-0.1.0-py3-none-any.whl. Terraform uploads it to the bucket; every node installs exactly this wheel."
  type        = string

  validation {
    condition     = can(regex("^moshray-[0-9][0-9A-Za-z.+!]*-py3-none-any[.]whl$", basename(var.moshray_wheel_path)))
    error_message = "moshray_wheel_path must name a wheel built from the checkout, moshray-<version>-py3-none-any.whl (python -m pip wheel --no-deps -w dist .)."
  }
  validation {
    condition     = fileexists(var.moshray_wheel_path)
    error_message = "moshray_wheel_path does not exist: build the wheel first (python -m pip wheel --no-deps -w dist . at the repository root)."
  }
}


variable "ray_version" {
  description = "Ray version every node installs (ray[default,train]==this); use the version of the machine you submit jobs from (python -c 'import ray; print(ray.__version__)')."
  type        = string
  default     = "2.60.0"

  validation {
    condition     = can(regex("^[0-9]+[.][0-9]+[.][0-9]+$", var.ray_version))
    error_message = "ray_version must be an exact version such as 2.60.0."
  }
}


variable "torch_version" {
  description = "torch version every node installs (torch==this; the PyPI build, CUDA included on Linux x86_64)."
  type        = string
  default     = "2.13.0"

  validation {
    condition     = can(regex("^[0-9]+[.][0-9]+[.][0-9]+$", var.torch_version))
    error_message = "torch_version must be an exact version such as 2.13.0."
  }
}


variable "existing_bucket" {
  description = "Use this GCS bucket (name) for checkpoints, data, expert snapshots and the wheel instead of creating one (null: create <project_id>-<name>). The service accounts get access to it; it needs uniform bucket-level access (the write grant has an IAM condition)."
  type        = string
  default     = null

  validation {
    condition     = var.existing_bucket == null || can(regex("^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$", var.existing_bucket))
    error_message = "existing_bucket must be an S3 bucket name (not a gs:// URI)."
  }
}


variable "storage_prefix" {
  description = "Key prefix in the bucket for checkpoints, data and expert snapshots: checkpoint.uri is gs://<bucket>/<storage_prefix>. Nodes may write only under it."
  type        = string
  default     = "moshray"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9_.-]*(/[a-z0-9][a-z0-9_.-]*)*$", var.storage_prefix)) && var.storage_prefix != "wheels"
    error_message = "storage_prefix must be a relative key prefix without leading or trailing '/', and not wheels (where the wheel lives)."
  }
}


variable "bucket_force_destroy" {
  description = "Let terraform destroy delete the created bucket with its checkpoints in it (false: destroy stops at a non-empty bucket)."
  type        = bool
  default     = false
}


variable "use_internal_ips" {
  description = "provider.use_internal_ips of the rendered Ray cluster config (the autoscaler_config output). false: `ray up` / `ray attach` from a laptop reach nodes at their public addresses. true: only from inside the VPC network. The head's own autoscaler never uses SSH (disable_node_updaters), so it works either way."
  type        = bool
  default     = false
}


variable "token_version" {
  description = "Bump to generate and store a new Ray auth token (then restart Ray on the nodes)."
  type        = number
  default     = 1

  validation {
    condition     = var.token_version >= 1 && floor(var.token_version) == var.token_version
    error_message = "token_version must be a whole number >= 1."
  }
}

variable "enable_apis" {
  description = "Enable the Compute, IAM and Secret Manager APIs in the project (false if they are managed elsewhere)."
  type        = bool
  default     = true
}

variable "labels" {
  description = "Extra labels on every labelled resource (the moshray-* keys are reserved)."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.labels) : !startswith(k, "moshray-")])
    error_message = "labels must not use the reserved moshray-* keys."
  }
}
