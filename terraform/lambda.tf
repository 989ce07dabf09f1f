# SQS event source mappings of the worker Lambda function: one for the task queue and one for each routed queue.
# ReportBatchItemFailures is required: without it Lambda deletes a whole batch, failed deliveries included.
locals {
  event_sources = var.worker_function_name == null ? {} : merge(
    {
      tasks = {
        arn                 = aws_sqs_queue.tasks.arn
        fifo                = false
        batch_size          = var.batch_size
        maximum_concurrency = var.maximum_concurrency
      }
    },
    {
      for key, q in local.queues : key => {
        arn                 = aws_sqs_queue.routed[key].arn
        fifo                = q.fifo
        batch_size          = q.batch_size
        maximum_concurrency = q.maximum_concurrency != null ? q.maximum_concurrency : var.maximum_concurrency
      }
    },
  )
}

resource "aws_lambda_event_source_mapping" "worker" {
  for_each = local.event_sources

  function_name           = var.worker_function_name
  event_source_arn        = each.value.arn
  function_response_types = ["ReportBatchItemFailures"]
  batch_size              = each.value.batch_size
  # A standard queue's mapping may take more than 10 messages only with a batching window.
  maximum_batching_window_in_seconds = !each.value.fifo && each.value.batch_size > 10 ? 1 : null

  dynamic "scaling_config" {
    for_each = each.value.maximum_concurrency != null ? [each.value.maximum_concurrency] : []
    content {
      maximum_concurrency = scaling_config.value
    }
  }

  tags = var.tags

  # Lambda polls the queues with the function's role: the worker policy must be attached first.
  depends_on = [aws_iam_role_policy_attachment.worker]
}
