# The World's table, identical to what celery_workflow.world_sqs.create_table creates (table_definition()): string
# keys pk/sk, the list index projecting its keys and status, list_group its keys only, and time to live on expires_at.
resource "aws_dynamodb_table" "this" {
  name         = var.name
  billing_mode = "PAY_PER_REQUEST"
  hash_key     = "pk"
  range_key    = "sk"

  deletion_protection_enabled = var.deletion_protection

  attribute {
    name = "pk"
    type = "S"
  }

  attribute {
    name = "sk"
    type = "S"
  }

  attribute {
    name = "list_pk"
    type = "S"
  }

  attribute {
    name = "list_sk"
    type = "S"
  }

  attribute {
    name = "list_group_pk"
    type = "S"
  }

  attribute {
    name = "list_group_sk"
    type = "S"
  }

  global_secondary_index {
    name               = "list"
    hash_key           = "list_pk"
    range_key          = "list_sk"
    projection_type    = "INCLUDE"
    non_key_attributes = ["status"]
  }

  # keys only: a run's status changes write nothing to it (list_runs(workflow=...) reads the status from META). A
  # table of an earlier version (projecting status) has it rebuilt by the apply: deleted, then created and backfilled
  global_secondary_index {
    name            = "list_group"
    hash_key        = "list_group_pk"
    range_key       = "list_group_sk"
    projection_type = "KEYS_ONLY"
  }

  server_side_encryption {
    enabled = true
  }

  point_in_time_recovery {
    enabled = var.point_in_time_recovery
  }

  # the items of an ended run carry their retention's end here (epoch seconds): DynamoDB deletes them for free
  # (celery_workflow._aws.table.TTL_ATTRIBUTE, which create_table enables too)
  ttl {
    attribute_name = "expires_at"
    enabled        = true
  }

  tags = var.tags
}
