# The task queue: deliveries of workflows not routed elsewhere (Celery's default queue).
resource "aws_sqs_queue" "tasks_dead_letter" {
  name                      = "${var.name}-tasks-dlq"
  message_retention_seconds = var.message_retention_seconds
  sqs_managed_sse_enabled   = true
  tags                      = var.tags
}

resource "aws_sqs_queue" "tasks" {
  name                       = "${var.name}-tasks"
  visibility_timeout_seconds = var.visibility_timeout_seconds
  message_retention_seconds  = var.message_retention_seconds
  sqs_managed_sse_enabled    = true

  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.tasks_dead_letter.arn
    maxReceiveCount     = var.max_receive_count
  })

  tags = var.tags
}

# Routed queues, each with its own dead-letter queue (FIFO for a FIFO queue, as SQS requires).
resource "aws_sqs_queue" "routed_dead_letter" {
  for_each = local.queues

  name                        = each.value.dead_letter_name
  fifo_queue                  = each.value.fifo ? true : null
  content_based_deduplication = each.value.fifo ? true : null
  message_retention_seconds   = var.message_retention_seconds
  sqs_managed_sse_enabled     = true
  tags                        = var.tags
}

resource "aws_sqs_queue" "routed" {
  for_each = local.queues

  name = each.value.name
  # The Scheduler sends delayed FIFO deliveries without a deduplication ID: content-based deduplication is required
  # (the World makes every body unique).
  fifo_queue                  = each.value.fifo ? true : null
  content_based_deduplication = each.value.fifo ? true : null
  visibility_timeout_seconds  = each.value.visibility_timeout_seconds
  message_retention_seconds   = var.message_retention_seconds
  sqs_managed_sse_enabled     = true

  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.routed_dead_letter[each.key].arn
    maxReceiveCount     = each.value.max_receive_count
  })

  tags = var.tags

  lifecycle {
    precondition {
      condition     = !each.value.fifo || var.enable_scheduler
      error_message = "queues[\"${each.key}\"] is FIFO: FIFO queues take no per-message delay, so the World sends every delayed FIFO delivery through the Scheduler; set enable_scheduler = true."
    }
  }
}
