"""The router: the OpenAI HTTP front and the public gRPC API over one RouterCore, and the `tandem up` launcher."""
