"""Review: flags raised at grade time, the review API and web pages, statistics and export."""
