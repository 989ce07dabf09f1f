# Least-privilege managed policies of the two sides of the World (seed "IAM"):
#
# * the worker (Celery workers, or the Lambda function behind the event source mappings) runs deliveries: it reads
#   and writes the table, deletes expired runs (BatchWriteItem), sends to, receives from and deletes off the queues,
#   and schedules deliveries due more than 15 minutes ahead;
# * the API (clients starting, cancelling and reading runs, the HTTP handler) reads and writes the table, sends to
#   the queues and, with the Scheduler, creates a cancelled run's expiry schedule and deletes schedules.
#
# TransactWriteItems (Put, Update and Delete actions, no ConditionCheck) and TransactGetItems are authorized through
# the item actions they contain (PutItem, UpdateItem, DeleteItem, GetItem), so they need no action of their own.
# Creating a schedule that names the Scheduler role needs iam:PassRole on that role, for the API as for the worker.

locals {
  table_item_actions = [
    "dynamodb:BatchGetItem",
    "dynamodb:DeleteItem",
    "dynamodb:GetItem",
    "dynamodb:PutItem",
    "dynamodb:Query",
    "dynamodb:UpdateItem",
  ]
  table_resources = [aws_dynamodb_table.this.arn, "${aws_dynamodb_table.this.arn}/index/*"]
}

# Both sides: the table's items and its indexes.
data "aws_iam_policy_document" "table" {
  statement {
    sid       = "Table"
    effect    = "Allow"
    actions   = local.table_item_actions
    resources = local.table_resources
  }
}

# Both sides, with the Scheduler: create and delete our schedules (celery-workflow-<id>), and pass the Scheduler role
# they name (the seed lists iam:PassRole for the worker only; AWS needs it for the API's CreateSchedule as well).
data "aws_iam_policy_document" "schedules" {
  count = var.enable_scheduler ? 1 : 0

  statement {
    sid       = "Schedules"
    effect    = "Allow"
    actions   = ["scheduler:CreateSchedule", "scheduler:DeleteSchedule"]
    resources = [local.schedule_arn_pattern]
  }

  statement {
    sid       = "PassSchedulerRole"
    effect    = "Allow"
    actions   = ["iam:PassRole"]
    resources = [aws_iam_role.scheduler[0].arn]

    condition {
      test     = "StringEquals"
      variable = "iam:PassedToService"
      values   = ["scheduler.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "worker" {
  source_policy_documents = concat([data.aws_iam_policy_document.table.json], data.aws_iam_policy_document.schedules[*].json)

  statement {
    sid       = "DeleteExpiredRuns"
    effect    = "Allow"
    actions   = ["dynamodb:BatchWriteItem"]
    resources = [aws_dynamodb_table.this.arn]
  }

  statement {
    sid    = "Queues"
    effect = "Allow"
    actions = [
      "sqs:ChangeMessageVisibility",
      "sqs:DeleteMessage",
      "sqs:GetQueueAttributes",
      "sqs:ReceiveMessage",
      "sqs:SendMessage",
    ]
    resources = local.queue_arns
  }

  statement {
    sid    = "DeadLetterQueues"
    effect = "Allow"
    actions = [
      "sqs:ChangeMessageVisibility",
      "sqs:DeleteMessage",
      "sqs:ReceiveMessage",
      "sqs:SendMessage",
    ]
    resources = local.dead_letter_arns
  }
}

data "aws_iam_policy_document" "api" {
  source_policy_documents = concat([data.aws_iam_policy_document.table.json], data.aws_iam_policy_document.schedules[*].json)

  statement {
    sid       = "Queues"
    effect    = "Allow"
    actions   = ["sqs:SendMessage"]
    resources = local.queue_arns
  }
}

resource "aws_iam_policy" "worker" {
  name        = "${var.name}-worker"
  description = "Worker side of the ${var.name} workflow World: table, queues and schedules."
  policy      = data.aws_iam_policy_document.worker.json
  tags        = var.tags
}

resource "aws_iam_policy" "api" {
  name        = "${var.name}-api"
  description = "API side of the ${var.name} workflow World: table, sending to the queues, schedules."
  policy      = data.aws_iam_policy_document.api.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "worker" {
  count = var.worker_role_name != null ? 1 : 0

  role       = var.worker_role_name
  policy_arn = aws_iam_policy.worker.arn
}

resource "aws_iam_role_policy_attachment" "api" {
  count = var.api_role_name != null ? 1 : 0

  role       = var.api_role_name
  policy_arn = aws_iam_policy.api.arn
}
