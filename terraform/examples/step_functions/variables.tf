variable "tasks_table" {
  description = "The task_status example's DynamoDB table (the seed's Tasks)."
  type        = string
  default     = "Tasks"
}

variable "sample_queue" {
  description = "The sqs_redrive example's queue; its dead-letter queue is <sample_queue>-dlq."
  type        = string
  default     = "sample"
}

variable "max_receive_count" {
  description = "Receives of a message on the sample queue before SQS moves it to the dead-letter queue."
  type        = number
  default     = 3
}

variable "role_name" {
  description = "Attach the examples' policy (the steps' calls) to this role: the World's worker role. Null: attach nothing."
  type        = string
  default     = null
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
