output "tasks_table" {
  description = "TASKS_TABLE for examples/task_status.py."
  value       = aws_dynamodb_table.tasks.name
}

output "sample_queue_url" {
  description = "The queue the Processor reads (python -m examples.sqs_redrive process --queue-url …)."
  value       = aws_sqs_queue.sample.url
}

output "dead_letter_queue_arn" {
  description = "The re-drive's input: {\"queueArn\": <this>}."
  value       = aws_sqs_queue.sample_dead_letter.arn
}

output "dead_letter_queue_url" {
  description = "The sample queue's dead-letter queue."
  value       = aws_sqs_queue.sample_dead_letter.url
}

output "policy_arn" {
  description = "The examples' policy (attach it to the role the steps run with)."
  value       = aws_iam_policy.examples.arn
}
