# EventBridge Scheduler: the group of the World's one-time schedules (celery-workflow-<id>) and the role Scheduler
# assumes to send their messages to the queues.
resource "aws_scheduler_schedule_group" "this" {
  count = var.enable_scheduler ? 1 : 0

  name = var.name
  tags = var.tags
}

data "aws_iam_policy_document" "scheduler_trust" {
  count = var.enable_scheduler ? 1 : 0

  statement {
    sid     = "SchedulerAssumesRole"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["scheduler.amazonaws.com"]
    }

    # Only the schedules of this account's group may use the role (confused deputy protection).
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account]
    }

    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [aws_scheduler_schedule_group.this[0].arn]
    }
  }
}

data "aws_iam_policy_document" "scheduler_send" {
  count = var.enable_scheduler ? 1 : 0

  statement {
    sid       = "SendToQueues"
    effect    = "Allow"
    actions   = ["sqs:SendMessage"]
    resources = local.queue_arns
  }
}

resource "aws_iam_role" "scheduler" {
  count = var.enable_scheduler ? 1 : 0

  name               = "${var.name}-scheduler"
  description        = "Assumed by EventBridge Scheduler to deliver the ${var.name} workflow schedules to their queues."
  assume_role_policy = data.aws_iam_policy_document.scheduler_trust[0].json
  tags               = var.tags
}

resource "aws_iam_role_policy" "scheduler_send" {
  count = var.enable_scheduler ? 1 : 0

  name   = "send-to-queues"
  role   = aws_iam_role.scheduler[0].id
  policy = data.aws_iam_policy_document.scheduler_send[0].json
}
