"""Plain Kafka workers (kafka-python): generation, reward, and the shared consume/produce shell."""
