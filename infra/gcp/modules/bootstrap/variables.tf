variable "cluster_name" {
  description = "Cluster name: the value of the moshray-cluster label and Ray's cluster_name."
  type        = string
}

variable "project_id" {
  description = "GCP project of the cluster."
  type        = string
}

variable "pools" {
  description = "Spot pools the NodeProvider tries, in order: machine type and zone."
  type = list(object({
    machine_type = string
    zone         = string
  }))

  validation {
    condition     = length(var.pools) > 0
    error_message = "pools must name at least one machine type and zone."
  }
}

variable "termination_action" {
  description = "What GCE does to a preempted Spot VM: DELETE or STOP."
  type        = string
}

variable "head_private_ip" {
  description = "Internal IPv4 address of the head node (workers join Ray there)."
  type        = string
}

variable "token_secret" {
  description = "Secret Manager secret holding the Ray auth token, as projects/PROJECT/secrets/NAME."
  type        = string
}

variable "subnetwork" {
  description = "Self link of the subnetwork of the workers."
  type        = string
}

variable "network_tags" {
  description = "Network tags of worker VMs (the firewall rules match them)."
  type        = list(string)
}

variable "worker_service_account" {
  description = "Email of the workers' service account."
  type        = string
}

variable "worker_image" {
  description = "Boot image of worker VMs."
  type        = string
}

variable "worker_disk_gb" {
  description = "Boot disk of a worker VM in GB."
  type        = number
}

variable "worker_accelerators" {
  description = "GPUs attached to each worker VM (none for machine types with built-in GPUs such as g2)."
  type = list(object({
    type  = string
    count = number
  }))
}

variable "min_workers" {
  description = "Spot workers Ray's autoscaler keeps at least."
  type        = number
}

variable "max_workers" {
  description = "Spot workers Ray's autoscaler launches at most."
  type        = number
}

variable "worker_resources" {
  description = "Ray resources of one worker (CPU, GPU) as the autoscaler plans with them."
  type        = map(number)
}

variable "on_demand_max_nodes" {
  description = "On-demand workers the NodeProvider may use when no spot pool has capacity (0: never)."
  type        = number
}

variable "idle_timeout_minutes" {
  description = "Minutes an idle worker is kept before the autoscaler removes it."
  type        = number
}

variable "wheel_bucket" {
  description = "GCS bucket holding the moshray wheel the nodes install (one version everywhere)."
  type        = string
}

variable "wheel_key" {
  description = "Object name of the wheel in wheel_bucket, ending in its wheel file name (wheels/moshray-0.1.0-py3-none-any.whl)."
  type        = string

  validation {
    condition     = can(regex("(^|/)moshray-[^/]+[.]whl$", var.wheel_key))
    error_message = "wheel_key must end in a moshray wheel file name (pip reads the version from it)."
  }
}

variable "ray_version" {
  description = "Ray version every node installs (ray[default,train]==this)."
  type        = string
}

variable "torch_version" {
  description = "torch version every node installs (torch==this)."
  type        = string
}

variable "use_internal_ips" {
  description = "provider.use_internal_ips of the rendered Ray cluster config (false: `ray up` from a laptop uses public addresses)."
  type        = bool
}

variable "prometheus_config" {
  description = "Text of the Prometheus scrape config installed on the head (infra/prometheus/prometheus.yml)."
  type        = string
}

variable "ray_port" {
  description = "Port of the head's Ray GCS."
  type        = number
}

variable "dashboard_port" {
  description = "Port of the Ray dashboard and job API on the head."
  type        = number
}

variable "prometheus_port" {
  description = "Port of Prometheus on the head (RAY_PROMETHEUS_HOST of Ray's dashboard)."
  type        = number
  default     = 9090
}

variable "grafana_host" {
  description = "Grafana as the head reaches it (RAY_GRAFANA_HOST: Ray's dashboard checks it for its Metrics tab), e.g. Grafana on the head or an SSH reverse tunnel to yours."
  type        = string
  default     = "http://127.0.0.1:3000"
}

variable "grafana_iframe_host" {
  description = "Grafana as your browser reaches it (RAY_GRAFANA_IFRAME_HOST: the Metrics tab embeds its panels from there)."
  type        = string
  default     = "http://localhost:3000"
}

variable "checkpoint_uri" {
  description = "Durable checkpoint location of the cluster's jobs (MOSHRAY_CHECKPOINT_URI on the head): a job without checkpoint.uri checkpoints there and a resubmitted job resumes from it."
  type        = string
}
