terraform {
  # 1.11: ephemeral resources and write-only arguments keep the Ray token out of the state.
  required_version = ">= 1.11"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 6.10, < 7.0"
    }
    random = {
      source  = "hashicorp/random"
      version = ">= 3.7.1, < 4.0"
    }
  }
}
