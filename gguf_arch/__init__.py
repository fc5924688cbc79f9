"""What Kimi K3 / K3.1-Pro is: config reader, tensor and key tables, transforms, MXFP4 repack."""
