# What the two Step Functions examples use besides the World (the module in ../../ provisions the World):
#
# * examples/task_status.py: the Tasks table (partition key taskId, string; sort key timestamp, number), the same
#   table `python -m examples.task_status setup` creates;
# * examples/sqs_redrive.py: the sample queue and its dead-letter queue with a redrive policy, the same queues
#   `python -m examples.sqs_redrive setup` creates;
# * a policy with what the examples' steps call: PutItem/UpdateItem/Query on Tasks, and the message move task API
#   with what a move needs (receive and delete on the dead-letter queue, send to the source queue).

resource "aws_dynamodb_table" "tasks" {
  name         = var.tasks_table
  billing_mode = "PAY_PER_REQUEST"
  hash_key     = "taskId"
  range_key    = "timestamp"

  attribute {
    name = "taskId"
    type = "S"
  }

  attribute {
    name = "timestamp"
    type = "N"
  }

  tags = var.tags
}

resource "aws_sqs_queue" "sample_dead_letter" {
  name = "${var.sample_queue}-dlq"
  tags = var.tags
}

resource "aws_sqs_queue" "sample" {
  name = var.sample_queue
  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.sample_dead_letter.arn
    maxReceiveCount     = var.max_receive_count
  })
  tags = var.tags
}

data "aws_iam_policy_document" "examples" {
  statement {
    sid       = "TasksTable"
    actions   = ["dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:Query"]
    resources = [aws_dynamodb_table.tasks.arn]
  }

  statement {
    sid = "Redrive"
    actions = [
      "sqs:CancelMessageMoveTask",
      "sqs:DeleteMessage",
      "sqs:GetQueueAttributes",
      "sqs:ListMessageMoveTasks",
      "sqs:ReceiveMessage",
      "sqs:StartMessageMoveTask",
    ]
    resources = [aws_sqs_queue.sample_dead_letter.arn]
  }

  statement {
    sid       = "RedriveDestination"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.sample.arn]
  }
}

resource "aws_iam_policy" "examples" {
  name        = "${var.sample_queue}-examples"
  description = "What the task_status and sqs_redrive examples' steps call."
  policy      = data.aws_iam_policy_document.examples.json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "examples" {
  count = var.role_name != null ? 1 : 0

  role       = var.role_name
  policy_arn = aws_iam_policy.examples.arn
}
