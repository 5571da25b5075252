terraform {
  # 1.11: ephemeral resources and write-only arguments keep the Ray token out of the state.
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
