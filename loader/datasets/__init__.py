"""The datasets the loader brings: files, Parquet, object stores."""
