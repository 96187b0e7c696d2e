"""Code shared by every Tandem service: configs, model description, logging, TLS, gRPC."""
