terraform {
  # optional() object attributes with defaults need Terraform 1.3.
  required_version = ">= 1.3"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.70" # tags on aws_lambda_event_source_mapping
    }
  }
}
