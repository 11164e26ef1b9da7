"""sparring for trainers: `sparring.client` runs rollouts against a sparring server (httpx + openai)."""
