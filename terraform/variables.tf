variable "name" {
  description = "Prefix of every resource name: the table is named after it, the queues <name>-tasks and <name>-<queue>, the schedule group <name>, the roles and policies <name>-scheduler, <name>-worker and <name>-api."
  type        = string
  default     = "workflow"
  nullable    = false

  validation {
    # The name ends up in SQS queue names (letters, digits, hyphens and underscores; 80 characters with -dlq.fifo),
    # IAM role names (64 characters with -scheduler) and the table and schedule group names.
    condition     = can(regex("^[A-Za-z0-9_-]{1,40}$", var.name))
    error_message = "name must be 1 to 40 letters, digits, hyphens or underscores (it is part of SQS queue and IAM role names)."
  }
}

variable "tags" {
  description = "Tags for every resource the module creates."
  type        = map(string)
  default     = {}
  nullable    = false
}

variable "point_in_time_recovery" {
  description = "Point-in-time recovery of the table."
  type        = bool
  default     = true
  nullable    = false
}

variable "deletion_protection" {
  description = "Deletion protection of the table (turn it off, and apply, before destroying the table)."
  type        = bool
  default     = true
  nullable    = false
}

variable "visibility_timeout_seconds" {
  description = "Visibility timeout of the queues. Keep it above the worker Lambda's timeout."
  type        = number
  default     = 360
  nullable    = false

  validation {
    condition     = var.visibility_timeout_seconds >= 0 && var.visibility_timeout_seconds <= 43200 && floor(var.visibility_timeout_seconds) == var.visibility_timeout_seconds
    error_message = "visibility_timeout_seconds must be a whole number of seconds from 0 to 43200 (12 hours)."
  }
}

variable "message_retention_seconds" {
  description = "Message retention of the queues and their dead-letter queues (14 days by default)."
  type        = number
  default     = 1209600
  nullable    = false

  validation {
    # A delivery waits up to 15 minutes before it is due or sent again: a shorter retention drops deliveries.
    condition     = var.message_retention_seconds >= 3600 && var.message_retention_seconds <= 1209600 && floor(var.message_retention_seconds) == var.message_retention_seconds
    error_message = "message_retention_seconds must be a whole number of seconds from 3600 (one hour, the least the World needs) to 1209600 (14 days)."
  }
}

variable "max_receive_count" {
  description = "Receives of a message before SQS moves it to the dead-letter queue."
  type        = number
  default     = 10
  nullable    = false

  validation {
    condition     = var.max_receive_count >= 1 && var.max_receive_count <= 1000 && floor(var.max_receive_count) == var.max_receive_count
    error_message = "max_receive_count must be a whole number from 1 to 1000."
  }
}

variable "enable_scheduler" {
  description = "Create the EventBridge Scheduler schedule group and the role Scheduler assumes to send to the queues (needed for deliveries due more than 15 minutes ahead, FIFO queues and retentions over 15 minutes)."
  type        = bool
  default     = true
  nullable    = false
}

variable "worker_function_name" {
  description = "Name (or ARN) of the worker Lambda function. Setting it creates an SQS event source mapping with ReportBatchItemFailures for the task queue and for each routed queue."
  type        = string
  default     = null
}

variable "batch_size" {
  description = "Messages per worker invocation of the task queue's event source mapping (1 to 10000; above 10 the mapping batches for up to 1 second)."
  type        = number
  default     = 10
  nullable    = false

  validation {
    condition     = var.batch_size >= 1 && var.batch_size <= 10000 && floor(var.batch_size) == var.batch_size
    error_message = "batch_size must be a whole number from 1 to 10000."
  }
}

variable "maximum_concurrency" {
  description = "Cap on concurrent worker invocations for the task queue's event source mapping (2 to 1000; null: no cap)."
  type        = number
  default     = null

  validation {
    condition     = var.maximum_concurrency == null || try(var.maximum_concurrency >= 2 && var.maximum_concurrency <= 1000 && floor(var.maximum_concurrency) == var.maximum_concurrency, false)
    error_message = "maximum_concurrency must be null or a whole number from 2 to 1000."
  }
}

variable "worker_role_name" {
  description = "Name of an IAM role to attach the worker policy to (null: attach it yourself, see the worker_policy_arn output)."
  type        = string
  default     = null
}

variable "api_role_name" {
  description = "Name of an IAM role to attach the API policy to (null: attach it yourself, see the api_policy_arn output)."
  type        = string
  default     = null
}

variable "queues" {
  description = "Routed queues by routing name (the name workflows route to, e.g. @wf.workflow(queue=\"backfill\")), each with its own dead-letter queue. A FIFO queue gets the .fifo suffix and content-based deduplication, and needs the scheduler. batch_size defaults to 10; maximum_concurrency, visibility_timeout_seconds and max_receive_count default to the module's values."
  type = map(object({
    fifo                       = optional(bool, false)
    batch_size                 = optional(number, 10)
    maximum_concurrency        = optional(number)
    visibility_timeout_seconds = optional(number)
    max_receive_count          = optional(number)
  }))
  default  = {}
  nullable = false

  validation {
    # <name>-<key>-dlq.fifo must be a valid SQS name; "celery" is the default queue's routing name and "tasks" the
    # default queue's SQS name; a key ending in -dlq could take another queue's dead-letter queue name.
    condition     = alltrue([for k, q in var.queues : can(regex("^[A-Za-z0-9_-]{1,30}$", k)) && !contains(["celery", "tasks"], k) && !can(regex("-dlq$", k))])
    error_message = "queues: each key must be 1 to 30 letters, digits, hyphens or underscores (it is part of SQS queue names), must not end in -dlq, and must not be \"celery\" (the default queue) or \"tasks\" (the task queue's name)."
  }

  validation {
    condition     = alltrue([for k, q in var.queues : q.batch_size != null && try(q.batch_size >= 1 && floor(q.batch_size) == q.batch_size && q.batch_size <= (q.fifo ? 10 : 10000), false)])
    error_message = "queues: batch_size must be a whole number from 1 to 10000, and at most 10 for a FIFO queue."
  }

  validation {
    condition     = alltrue([for k, q in var.queues : q.maximum_concurrency == null || try(q.maximum_concurrency >= 2 && q.maximum_concurrency <= 1000 && floor(q.maximum_concurrency) == q.maximum_concurrency, false)])
    error_message = "queues: maximum_concurrency must be null or a whole number from 2 to 1000."
  }

  validation {
    condition     = alltrue([for k, q in var.queues : q.visibility_timeout_seconds == null || try(q.visibility_timeout_seconds >= 0 && q.visibility_timeout_seconds <= 43200 && floor(q.visibility_timeout_seconds) == q.visibility_timeout_seconds, false)])
    error_message = "queues: visibility_timeout_seconds must be null or a whole number of seconds from 0 to 43200."
  }

  validation {
    condition     = alltrue([for k, q in var.queues : q.max_receive_count == null || try(q.max_receive_count >= 1 && q.max_receive_count <= 1000 && floor(q.max_receive_count) == q.max_receive_count, false)])
    error_message = "queues: max_receive_count must be null or a whole number from 1 to 1000."
  }
}

variable "emulator_endpoint" {
  description = "URL of an AWS emulator (e.g. http://127.0.0.1:4566, python -m celery_workflow.testing.moto_server) that the provider's endpoints point at. Setting it adds the emulator's variables (AWS_ENDPOINT_URL, AWS_DEFAULT_REGION and emulator_credentials) to shell_environment and fills emulator_environment. It does not configure the provider: see \"Against an emulator\" in the README."
  type        = string
  default     = null

  validation {
    condition     = var.emulator_endpoint == null || can(regex("^https?://[^/]+/?$", var.emulator_endpoint))
    error_message = "emulator_endpoint must be null or an http:// or https:// URL of a host and port, without a path (e.g. http://127.0.0.1:4566)."
  }
}

variable "emulator_credentials" {
  description = "Dummy credentials the emulator accepts, exported with emulator_endpoint as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY. They appear in the outputs in clear: never put real credentials here."
  type = object({
    access_key_id     = string
    secret_access_key = string
  })
  default = {
    access_key_id     = "testing"
    secret_access_key = "testing"
  }
  nullable = false

  validation {
    condition     = length(var.emulator_credentials.access_key_id) > 0 && length(var.emulator_credentials.secret_access_key) > 0
    error_message = "emulator_credentials: access_key_id and secret_access_key must not be empty (an emulator accepts any value, e.g. \"testing\")."
  }
}

variable "tick_function_name" {
  description = "Name (or ARN) of the tick Lambda function (celery_workflow.aws_lambda.tick_handler), for a deployment without Celery workers. Setting it creates an EventBridge Scheduler schedule <name>-tick in the default group that invokes it every minute (rate(1 minute), no flexible window, no retry) and the role <name>-tick it uses, which may invoke that function only."
  type        = string
  default     = null
}
