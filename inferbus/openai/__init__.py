"""The OpenAI API's types as the platform uses them: request bodies, errors, sampling parameters,
response bodies and the Files/Batch objects. Shared by the gateway and the batch service."""
