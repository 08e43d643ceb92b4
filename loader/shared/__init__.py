"""What the processes share: the control words, the batch table, the rings' messages, the spill heap, layouts."""
