# The tick of a deployment without Celery workers: an EventBridge Scheduler schedule that invokes the tick function
# (celery_workflow.aws_lambda.tick_handler) every minute, to fire the workflow schedules and send the starts their
# writers left unsent. Its role may invoke that function only.
locals {
  tick_function_arn = var.tick_function_name == null ? null : (
    can(regex("^arn:", var.tick_function_name)) ? var.tick_function_name : "arn:${local.partition}:lambda:${local.region}:${local.account}:function:${var.tick_function_name}"
  )
  # The tick schedule lives in the default group (the module's group holds the World's one-time schedules, and exists
  # only with the Scheduler).
  tick_group_arn = "arn:${local.partition}:scheduler:${local.region}:${local.account}:schedule-group/default"
}

data "aws_iam_policy_document" "tick_trust" {
  count = var.tick_function_name == null ? 0 : 1

  statement {
    sid     = "SchedulerAssumesRole"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["scheduler.amazonaws.com"]
    }

    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account]
    }

    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [local.tick_group_arn]
    }
  }
}

data "aws_iam_policy_document" "tick_invoke" {
  count = var.tick_function_name == null ? 0 : 1

  statement {
    sid       = "InvokeTickFunction"
    effect    = "Allow"
    actions   = ["lambda:InvokeFunction"]
    resources = [local.tick_function_arn]
  }
}

resource "aws_iam_role" "tick" {
  count = var.tick_function_name == null ? 0 : 1

  name               = "${var.name}-tick"
  description        = "Assumed by EventBridge Scheduler to invoke the ${var.name} tick function every minute."
  assume_role_policy = data.aws_iam_policy_document.tick_trust[0].json
  tags               = var.tags
}

resource "aws_iam_role_policy" "tick_invoke" {
  count = var.tick_function_name == null ? 0 : 1

  name   = "invoke-tick-function"
  role   = aws_iam_role.tick[0].id
  policy = data.aws_iam_policy_document.tick_invoke[0].json
}

resource "aws_scheduler_schedule" "tick" {
  count = var.tick_function_name == null ? 0 : 1

  name                = "${var.name}-tick"
  group_name          = "default"
  description         = "Invokes the ${var.name} tick function: due workflow schedules, unsent starts."
  schedule_expression = "rate(1 minute)"

  flexible_time_window {
    mode = "OFF"
  }

  target {
    arn      = local.tick_function_arn
    role_arn = aws_iam_role.tick[0].arn
    input    = jsonencode({ source = "celery-workflow.tick" })

    # A tick missed is done by the next one a minute later: no late delivery, no retry.
    retry_policy {
      maximum_event_age_in_seconds = 60
      maximum_retry_attempts       = 0
    }
  }

  # Scheduler checks that it may assume the role and invoke the function when the schedule is created.
  depends_on = [aws_iam_role_policy.tick_invoke]
}
