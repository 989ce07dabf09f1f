# The AWS World behind two Lambda functions: the worker, fed by the module's SQS event source mappings
# (celery_workflow.aws_lambda.queue_handler), and the API behind a Function URL (http_handler).
#
#   worker.py:  from celery_workflow.aws_lambda import queue_handler
#               from myapp import wf      # Workflows(Celery("app"), world=AWSWorld.from_env(), configure_broker=False)
#               handler = queue_handler(wf)
#
#   api.py:     from celery_workflow.aws_lambda import http_handler
#               from myapp import wf
#               handler = http_handler(wf)

data "aws_partition" "current" {}

data "aws_iam_policy_document" "lambda_trust" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["lambda.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "worker" {
  name               = "${var.name}-worker-function"
  assume_role_policy = data.aws_iam_policy_document.lambda_trust.json
}

resource "aws_iam_role" "api" {
  name               = "${var.name}-api-function"
  assume_role_policy = data.aws_iam_policy_document.lambda_trust.json
}

# CloudWatch Logs for both functions (the module's policies cover the World only).
resource "aws_iam_role_policy_attachment" "worker_logs" {
  role       = aws_iam_role.worker.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole"
}

resource "aws_iam_role_policy_attachment" "api_logs" {
  role       = aws_iam_role.api.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole"
}

module "workflow" {
  source = "../.."

  name                 = var.name
  worker_function_name = aws_lambda_function.worker.function_name
  worker_role_name     = aws_iam_role.worker.name
  api_role_name        = aws_iam_role.api.name

  # @wf.workflow(queue="backfill") runs go to their own queue, with fewer concurrent invocations.
  queues = {
    backfill = { maximum_concurrency = 2 }
  }
}

locals {
  environment = merge(module.workflow.environment, {
    WORKFLOW_BASE_URL = var.base_url
  })
}

resource "aws_lambda_function" "worker" {
  function_name    = "${var.name}-worker"
  role             = aws_iam_role.worker.arn
  runtime          = var.runtime
  handler          = "worker.handler"
  filename         = var.package_file
  source_code_hash = filebase64sha256(var.package_file)
  memory_size      = 512
  timeout          = 300 # below the queues' visibility timeout (360 by default)

  environment {
    variables = local.environment
  }
}

resource "aws_lambda_function" "api" {
  function_name    = "${var.name}-api"
  role             = aws_iam_role.api.arn
  runtime          = var.runtime
  handler          = "api.handler"
  filename         = var.package_file
  source_code_hash = filebase64sha256(var.package_file)
  memory_size      = 512
  timeout          = 30

  environment {
    variables = local.environment
  }
}

# The HTTP handlers do not authenticate: the Function URL requires SigV4-signed requests (AWS_IAM).
resource "aws_lambda_function_url" "api" {
  function_name      = aws_lambda_function.api.function_name
  authorization_type = "AWS_IAM"
}
