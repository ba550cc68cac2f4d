"""What a micro-batch's loss is: next-token prediction (SFT), or a preference loss over chosen/rejected pairs."""
