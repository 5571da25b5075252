variable "name" {
  description = "Cluster name: prefix of every resource, the value of the moshray-cluster tag and Ray's cluster_name."
  type        = string
  default     = "moshray"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name must be 3-32 lowercase letters, digits and '-', starting with a letter (it is also a GCP-safe label value)."
  }
}

variable "region" {
  description = "AWS region of the cluster (the provider's region must be the same)."
  type        = string
  default     = "us-east-1"

  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
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

variable "vpc_cidr" {
  description = "CIDR of the VPC this module creates (ignored when existing_vpc_id is set)."
  type        = string
  default     = "10.42.0.0/16"

  validation {
    condition     = can(cidrnetmask(var.vpc_cidr))
    error_message = "vpc_cidr must be an IPv4 CIDR such as 10.42.0.0/16."
  }
}

variable "zones" {
  description = "Availability zones that get a subnet when this module creates the network (at least two)."
  type        = list(string)
  default     = ["us-east-1a", "us-east-1b", "us-east-1c"]

  validation {
    condition     = length(distinct(var.zones)) >= 2
    error_message = "zones must name at least two different availability zones."
  }
}

variable "existing_vpc_id" {
  description = "Use this VPC instead of creating one (null: create). Give existing_subnet_ids with it."
  type        = string
  default     = null
}

variable "existing_subnet_ids" {
  description = "Subnets of existing_vpc_id by availability zone, at least two zones, e.g. { us-east-1a = \"subnet-...\" }. Their route tables must reach the internet (pip installs)."
  type        = map(string)
  default     = {}

  validation {
    condition     = length(var.existing_subnet_ids) == 0 || length(var.existing_subnet_ids) >= 2
    error_message = "existing_subnet_ids must name subnets in at least two availability zones (or none)."
  }
  validation {
    condition     = (var.existing_vpc_id == null) == (length(var.existing_subnet_ids) == 0)
    error_message = "Set existing_vpc_id and existing_subnet_ids together, or neither."
  }
}

variable "head_instance_type" {
  description = "Instance type of the on-demand head node (Ray GCS, dashboard, autoscaler, Coordinator, Prometheus)."
  type        = string
  default     = "m6i.large"
}

variable "head_volume_gb" {
  description = "Root volume of the head node in GiB."
  type        = number
  default     = 100

  validation {
    condition     = var.head_volume_gb >= 30
    error_message = "head_volume_gb must be at least 30 (the image plus moshray and torch)."
  }
}

variable "worker_pools" {
  description = "Spot pools the NodeProvider tries, best first: instance type x availability zone. Every zone needs a subnet (zones or existing_subnet_ids). All types should have the shape given in worker_resources."
  type = list(object({
    instance_type = string
    zone          = string
  }))
  default = [
    { instance_type = "g4dn.xlarge", zone = "us-east-1a" },
    { instance_type = "g4dn.xlarge", zone = "us-east-1b" },
    { instance_type = "g5.xlarge", zone = "us-east-1a" },
    { instance_type = "g5.xlarge", zone = "us-east-1b" },
    { instance_type = "g4dn.xlarge", zone = "us-east-1c" },
  ]

  validation {
    condition     = length(var.worker_pools) > 0 && length(distinct(var.worker_pools)) == length(var.worker_pools)
    error_message = "worker_pools must name at least one pool and no pool twice."
  }
}

variable "worker_resources" {
  description = "Ray resources of one worker, as Ray's autoscaler plans with them (CPU, GPU); the NodeProvider adds the spot resource."
  type        = map(number)
  default     = { CPU = 4, GPU = 1 }

  validation {
    condition     = contains(keys(var.worker_resources), "CPU")
    error_message = "worker_resources must give CPU (and GPU for GPU instance types)."
  }
}

variable "worker_volume_gb" {
  description = "Root volume of a spot worker in GiB."
  type        = number
  default     = 100

  validation {
    condition     = var.worker_volume_gb >= 30
    error_message = "worker_volume_gb must be at least 30."
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
  description = "Minutes an idle worker above min_workers is kept before it is terminated."
  type        = number
  default     = 5

  validation {
    condition     = var.idle_timeout_minutes >= 1
    error_message = "idle_timeout_minutes must be at least 1."
  }
}

variable "ami_id" {
  description = "AMI of head and workers (null: the latest AWS Deep Learning Base OSS Nvidia Driver GPU AMI, Ubuntu 22.04, x86_64)."
  type        = string
  default     = null
}

variable "key_name" {
  description = "EC2 key pair for SSH to the head and workers (null: no key; use EC2 Instance Connect or SSM)."
  type        = string
  default     = null
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
  description = "Use this S3 bucket (name) for checkpoints, data, expert snapshots and the wheel instead of creating one (null: create). The instance roles get access to it; SSE-KMS buckets also need kms:Decrypt / kms:GenerateDataKey, which this module does not grant."
  type        = string
  default     = null

  validation {
    condition     = var.existing_bucket == null || can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.existing_bucket))
    error_message = "existing_bucket must be an S3 bucket name (not an s3:// URI)."
  }
}

variable "storage_prefix" {
  description = "Key prefix in the bucket for checkpoints, data and expert snapshots: checkpoint.uri is s3://<bucket>/<storage_prefix>. Nodes may write only under it."
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
  description = "provider.use_internal_ips of the rendered Ray cluster config (the autoscaler_config output). false: `ray up` / `ray attach` from a laptop reach nodes at their public addresses. true: only from inside the VPC. The head's own autoscaler never uses SSH (disable_node_updaters), so it works either way."
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

variable "secret_recovery_days" {
  description = "Days Secrets Manager keeps the token after destroy (0: delete at once, 7-30: recoverable)."
  type        = number
  default     = 0

  validation {
    condition     = var.secret_recovery_days == 0 || (var.secret_recovery_days >= 7 && var.secret_recovery_days <= 30)
    error_message = "secret_recovery_days must be 0 or between 7 and 30."
  }
}

variable "tags" {
  description = "Extra tags on every resource (the moshray-* keys are reserved)."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.tags) : !startswith(k, "moshray-")])
    error_message = "tags must not use the reserved moshray-* keys."
  }
  validation {
    condition     = alltrue([for k in keys(var.tags) : can(regex("^[A-Za-z0-9+=,.@:_-]+$", k))])
    error_message = "tag keys must use only letters, digits and + = , . @ : _ - (workers expose their tags in instance metadata, which allows no others)."
  }
}
