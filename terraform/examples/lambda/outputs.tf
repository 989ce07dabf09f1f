output "api_url" {
  description = "Function URL of the RPC, AWS_IAM auth (append /v1/workflow/rpc)."
  value       = aws_lambda_function_url.api.function_url
}

output "webhooks_url" {
  description = "Public Function URL of the webhooks alone (append /v1/workflow/webhooks/<token>)."
  value       = aws_lambda_function_url.webhooks.function_url
}

output "environment" {
  description = "The World's environment, as both functions get it."
  value       = local.environment
}

output "worker_policy_arn" {
  description = "The worker's managed policy."
  value       = module.workflow.worker_policy_arn
}

output "shell_environment" {
  description = "The module's environment as export lines, for Celery workers and scripts beside the functions."
  value       = module.workflow.shell_environment
}
