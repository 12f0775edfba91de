"""What a run says: the narration's wording, journald and sd_notify."""
