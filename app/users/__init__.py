"""The server's simulated user (sparring.usersim), for remote rollouts and episodes."""
