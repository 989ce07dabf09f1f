locals {
  environment = merge(
    {
      WORKFLOW_TABLE     = aws_dynamodb_table.this.name
      WORKFLOW_QUEUE_URL = aws_sqs_queue.tasks.url
      # Keyed by routing name (what workflows route to), not by SQS queue name.
      WORKFLOW_QUEUES = jsonencode({
        for key, q in aws_sqs_queue.routed : key => { url = q.url, arn = q.arn, fifo = local.queues[key].fifo }
      })
    },
    var.enable_scheduler ? {
      WORKFLOW_QUEUE_ARN          = aws_sqs_queue.tasks.arn
      WORKFLOW_SCHEDULER_GROUP    = aws_scheduler_schedule_group.this[0].name
      WORKFLOW_SCHEDULER_ROLE_ARN = aws_iam_role.scheduler[0].arn
    } : {},
  )

  # An emulator's variables for a shell (never for a Lambda function's environment: AWS reserves these names there).
  emulator_variables = var.emulator_endpoint == null ? {} : {
    AWS_ENDPOINT_URL      = trimsuffix(var.emulator_endpoint, "/")
    AWS_DEFAULT_REGION    = local.region
    AWS_ACCESS_KEY_ID     = var.emulator_credentials.access_key_id
    AWS_SECRET_ACCESS_KEY = var.emulator_credentials.secret_access_key
  }
  shell_variables = merge(local.environment, local.emulator_variables)
}

output "environment" {
  description = "Environment variables of an AWS World (AWSConfig.from_env): WORKFLOW_TABLE, WORKFLOW_QUEUE_URL, WORKFLOW_QUEUES and, with the scheduler, WORKFLOW_QUEUE_ARN, WORKFLOW_SCHEDULER_GROUP and WORKFLOW_SCHEDULER_ROLE_ARN. Merge WORKFLOW_BASE_URL (and WORKFLOW_CONTROL_URL) into it yourself."
  value       = local.environment
}

output "shell_environment" {
  description = "The environment output as POSIX shell export lines, for a shell or a container entrypoint: eval \"$(terraform output -raw shell_environment)\". With emulator_endpoint, the emulator's variables too (emulator_environment)."
  value       = join("\n", [for key, value in local.shell_variables : "export ${key}='${replace(value, "'", "'\\''")}'"])
}

output "emulator_environment" {
  description = "With emulator_endpoint: AWS_ENDPOINT_URL, AWS_DEFAULT_REGION (the provider's region), AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (emulator_credentials), what boto3 needs to reach the emulator; null without it."
  value       = var.emulator_endpoint == null ? null : local.emulator_variables
}

output "table_name" {
  description = "Name of the DynamoDB table."
  value       = aws_dynamodb_table.this.name
}

output "table_arn" {
  description = "ARN of the DynamoDB table."
  value       = aws_dynamodb_table.this.arn
}

output "queue_url" {
  description = "URL of the task queue."
  value       = aws_sqs_queue.tasks.url
}

output "queue_arn" {
  description = "ARN of the task queue."
  value       = aws_sqs_queue.tasks.arn
}

output "dead_letter_queue_url" {
  description = "URL of the task queue's dead-letter queue."
  value       = aws_sqs_queue.tasks_dead_letter.url
}

output "dead_letter_queue_arn" {
  description = "ARN of the task queue's dead-letter queue."
  value       = aws_sqs_queue.tasks_dead_letter.arn
}

output "queues" {
  description = "Routed queues by routing name: url, arn, name, fifo, and their dead-letter queue's url and arn."
  value = {
    for key, q in aws_sqs_queue.routed : key => {
      url             = q.url
      arn             = q.arn
      name            = q.name
      fifo            = local.queues[key].fifo
      dead_letter_url = aws_sqs_queue.routed_dead_letter[key].url
      dead_letter_arn = aws_sqs_queue.routed_dead_letter[key].arn
    }
  }
}

output "scheduler_group_name" {
  description = "Name of the Scheduler schedule group (null without the scheduler)."
  value       = var.enable_scheduler ? aws_scheduler_schedule_group.this[0].name : null
}

output "scheduler_role_arn" {
  description = "ARN of the role Scheduler assumes to send to the queues (null without the scheduler)."
  value       = var.enable_scheduler ? aws_iam_role.scheduler[0].arn : null
}

output "worker_policy_arn" {
  description = "ARN of the worker's managed policy."
  value       = aws_iam_policy.worker.arn
}

output "api_policy_arn" {
  description = "ARN of the API's managed policy."
  value       = aws_iam_policy.api.arn
}

output "worker_policy_json" {
  description = "The worker policy document (JSON)."
  value       = data.aws_iam_policy_document.worker.json
}

output "api_policy_json" {
  description = "The API policy document (JSON)."
  value       = data.aws_iam_policy_document.api.json
}

output "scheduler_role_trust_policy_json" {
  description = "The Scheduler role's trust policy (JSON; null without the scheduler)."
  value       = var.enable_scheduler ? data.aws_iam_policy_document.scheduler_trust[0].json : null
}

output "scheduler_role_policy_json" {
  description = "The Scheduler role's inline policy allowing sqs:SendMessage on the queues (JSON; null without the scheduler)."
  value       = var.enable_scheduler ? data.aws_iam_policy_document.scheduler_send[0].json : null
}

output "event_source_mapping_uuids" {
  description = "UUIDs of the worker's event source mappings, by queue (\"tasks\" and the routing names); empty without worker_function_name."
  value       = { for key, m in aws_lambda_event_source_mapping.worker : key => m.uuid }
}

output "tick_schedule_arn" {
  description = "ARN of the schedule that invokes the tick function every minute (null without tick_function_name)."
  value       = var.tick_function_name == null ? null : aws_scheduler_schedule.tick[0].arn
}

output "tick_role_arn" {
  description = "ARN of the role the tick schedule invokes the tick function with (null without tick_function_name)."
  value       = var.tick_function_name == null ? null : aws_iam_role.tick[0].arn
}
