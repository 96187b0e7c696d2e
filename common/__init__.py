"""Code shared by every Tandem service: configs, model description, logging, test assets."""
