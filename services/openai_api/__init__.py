"""The OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions`, `/v1/models`
translated to the gateway's public gRPC API (`tandem.v1.GenerateService`)."""
