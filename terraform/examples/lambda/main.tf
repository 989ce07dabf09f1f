# The AWS World behind four Lambda functions: the worker, fed by the module's SQS event source mappings
# (celery_workflow.aws_lambda.queue_handler), the tick, invoked every minute by the module's Scheduler schedule
# (tick_handler: fires the workflow schedules and sends lost starts, which no Celery worker does here), the RPC behind
# a Function URL with AWS_IAM auth (rpc_handler), and the webhooks alone behind a public Function URL
# (webhook_handler: it serves no RPC, so the internet can start or cancel nothing; a webhook is authorised by its
# token).
#
#   worker.py:    from celery_workflow.aws_lambda import queue_handler
#                 from myapp import wf    # Workflows(Celery("app"), world=AWSWorld.from_env(), configure_broker=False)
#                 handler = queue_handler(wf)
#
#   tick.py:      from celery_workflow.aws_lambda import tick_handler
#                 from myapp import wf
#                 handler = tick_handler(wf)
#
#   api.py:       from celery_workflow.aws_lambda import rpc_handler
#                 from myapp import wf
#                 handler = rpc_handler(wf)
#
#   webhooks.py:  from celery_workflow.aws_lambda import webhook_handler
#                 from myapp import wf
#                 handler = webhook_handler(wf)
#
# (http_handler(wf) serves both endpoints from one function, for an API that is private as a whole.)

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
  tick_function_name   = aws_lambda_function.tick.function_name
  worker_role_name     = aws_iam_role.worker.name
  api_role_name        = aws_iam_role.api.name

  # @wf.workflow(queue="backfill") runs go to their own queue, with fewer concurrent invocations.
  queues = {
    backfill = { maximum_concurrency = 2 }
  }
}

locals {
  # Webhook URLs point at the public webhooks function unless base_url names another front (a domain of your own).
  base_url = var.base_url != "" ? var.base_url : "${trimsuffix(aws_lambda_function_url.webhooks.function_url, "/")}/v1/workflow"
  environment = merge(module.workflow.environment, {
    WORKFLOW_BASE_URL = local.base_url
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

# The tick: what a Celery worker's main process would do in the background, once a minute. It runs with the worker's
# role (the worker policy: it starts runs and sends their messages).
resource "aws_lambda_function" "tick" {
  function_name    = "${var.name}-tick"
  role             = aws_iam_role.worker.arn
  runtime          = var.runtime
  handler          = "tick.handler"
  filename         = var.package_file
  source_code_hash = filebase64sha256(var.package_file)
  memory_size      = 512
  timeout          = 60 # the ticker fires no further schedule past half of it

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

# The HTTP handlers do not authenticate: the RPC's Function URL requires SigV4-signed requests (AWS_IAM).
resource "aws_lambda_function_url" "api" {
  function_name      = aws_lambda_function.api.function_name
  authorization_type = "AWS_IAM"
}

# The webhooks alone, public: webhook_handler serves /v1/workflow/webhooks/<token> and nothing else. It resumes hooks
# (an append and a delivery), which the API policy allows. It needs no WORKFLOW_BASE_URL: it makes no webhook URLs.
resource "aws_lambda_function" "webhooks" {
  function_name    = "${var.name}-webhooks"
  role             = aws_iam_role.api.arn
  runtime          = var.runtime
  handler          = "webhooks.handler"
  filename         = var.package_file
  source_code_hash = filebase64sha256(var.package_file)
  memory_size      = 512
  timeout          = 30

  environment {
    variables = module.workflow.environment
  }
}

resource "aws_lambda_function_url" "webhooks" {
  function_name      = aws_lambda_function.webhooks.function_name
  authorization_type = "NONE"
}

# A public Function URL needs a resource policy that lets anyone invoke it through the URL.
resource "aws_lambda_permission" "webhooks_public" {
  statement_id           = "PublicWebhooks"
  action                 = "lambda:InvokeFunctionUrl"
  function_name          = aws_lambda_function.webhooks.function_name
  principal              = "*"
  function_url_auth_type = "NONE"
}
