data "aws_partition" "current" {}
data "aws_region" "current" {}
data "aws_caller_identity" "current" {}

locals {
  partition = data.aws_partition.current.partition
  region    = data.aws_region.current.name
  account   = data.aws_caller_identity.current.account_id

  # Routed queues with the module-level defaults filled in, and their SQS names (FIFO names end in .fifo).
  queues = {
    for key, q in var.queues : key => {
      fifo                       = q.fifo
      batch_size                 = q.batch_size
      maximum_concurrency        = q.maximum_concurrency
      visibility_timeout_seconds = coalesce(q.visibility_timeout_seconds, var.visibility_timeout_seconds)
      max_receive_count          = coalesce(q.max_receive_count, var.max_receive_count)
      name                       = q.fifo ? "${var.name}-${key}.fifo" : "${var.name}-${key}"
      dead_letter_name           = q.fifo ? "${var.name}-${key}-dlq.fifo" : "${var.name}-${key}-dlq"
    }
  }

  # Every queue the World sends to and the worker reads: the task queue, then the routed queues.
  queue_arns = concat([aws_sqs_queue.tasks.arn], [for key in sort(keys(local.queues)) : aws_sqs_queue.routed[key].arn])

  # Their dead-letter queues: workers move a message there themselves one receive before SQS would (to fail its run
  # with the cause), and `celery-workflow dead-letters` lists, redrives and purges them.
  dead_letter_arns = concat(
    [aws_sqs_queue.tasks_dead_letter.arn],
    [for key in sort(keys(local.queues)) : aws_sqs_queue.routed_dead_letter[key].arn],
  )

  # The schedules the World creates: celery-workflow-<delivery id> in the module's group.
  schedule_arn_pattern = var.enable_scheduler ? "arn:${local.partition}:scheduler:${local.region}:${local.account}:schedule/${aws_scheduler_schedule_group.this[0].name}/celery-workflow-*" : null
}
