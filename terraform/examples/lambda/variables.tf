variable "region" {
  description = "AWS region to deploy to."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Prefix of every resource name."
  type        = string
  default     = "workflow"
}

variable "package_file" {
  description = "Path of the deployment package: a zip holding your app (worker.py, api.py and webhooks.py, see main.tf) with celery_workflow and its dependencies."
  type        = string
}

variable "base_url" {
  description = "Public URL of the webhook endpoint including its /v1/workflow prefix (webhook URLs are built from it); empty: the webhooks function's URL."
  type        = string
  default     = ""
}

variable "runtime" {
  description = "Lambda runtime of both functions."
  type        = string
  default     = "python3.11"
}
