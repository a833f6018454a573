// Do-nothing ext-proc server in Go on grpc-go: the message sequence of kvgate's EPP (epp/extproc.py), every request
// sent to one -destination, nothing parsed beyond the message kinds — the Go twin of ../replies.py. No generated
// stubs: the service is registered by hand with a pass-through codec, and the few fields the answer needs are read
// and written with protowire (field numbers from envoy/service/ext_proc/v3/external_processor.proto).
package main

import (
	"flag"
	"io"
	"log"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/protobuf/encoding/protowire"
)

const (
	destinationHeader    = "x-gateway-destination-endpoint"
	destinationNamespace = "envoy.lb"
	fullDuplexStreamed   = 4 // ProcessingMode.BodySendMode
)

// ProcessingRequest's oneof fields and protocol_config; ProcessingResponse's fields.
const (
	reqRequestHeaders, reqResponseHeaders, reqRequestBody, reqResponseBody = 2, 3, 4, 5
	reqRequestTrailers, reqResponseTrailers, reqProtocolConfig             = 6, 7, 11
	respRequestHeaders, respResponseHeaders, respRequestBody               = 1, 2, 3
	respResponseBody, respRequestTrailers, respResponseTrailers            = 4, 5, 6
	respDynamicMetadata                                                    = 8
)

// rawCodec hands the messages' bytes through: the server reads and writes the wire format itself.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return *v.(*[]byte), nil }
func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	*v.(*[]byte) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

func message(field protowire.Number, body []byte) []byte {
	b := protowire.AppendTag(nil, field, protowire.BytesType)
	return protowire.AppendBytes(b, body)
}

func boolean(field protowire.Number) []byte {
	b := protowire.AppendTag(nil, field, protowire.VarintType)
	return protowire.AppendVarint(b, 1)
}

func concat(parts ...[]byte) []byte {
	var out []byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// structEntry: one google.protobuf.Struct `fields` map entry (key 1, Value 2).
func structEntry(key string, value []byte) []byte {
	return message(1, concat(message(1, []byte(key)), message(2, value)))
}

type answers struct {
	common   []byte // CommonResponse: the destination header set, clear_route_cache
	metadata []byte // ProcessingResponse.dynamic_metadata, tagged
}

func newAnswers(destination string) answers {
	header := message(1, concat(message(1, []byte(destinationHeader)), message(3, []byte(destination))))
	mutation := message(1, header) // HeaderMutation.set_headers: HeaderValueOption.header
	common := concat(message(2, mutation), boolean(5))
	inner := structEntry(destinationHeader, message(3, []byte(destination))) // Value.string_value
	outer := structEntry(destinationNamespace, message(5, inner))            // Value.struct_value
	return answers{common: common, metadata: message(respDynamicMetadata, outer)}
}

// streamed: a BodyResponse whose CommonResponse streams `body` back (body_mutation.streamed_response).
func streamed(field protowire.Number, body []byte, endOfStream bool) []byte {
	chunk := message(1, body)
	if endOfStream {
		chunk = append(chunk, boolean(2)...)
	}
	return message(field, message(1, message(3, message(3, chunk))))
}

// fields: each field of a message, number -> bytes (length-delimited) or varint.
func fields(b []byte, visit func(num protowire.Number, typ protowire.Type, value []byte, varint uint64)) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return
		}
		b = b[n:]
		switch typ {
		case protowire.BytesType:
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return
			}
			visit(num, typ, v, 0)
			b = b[m:]
		case protowire.VarintType:
			v, m := protowire.ConsumeVarint(b)
			if m < 0 {
				return
			}
			visit(num, typ, nil, v)
			b = b[m:]
		default:
			m := protowire.ConsumeFieldValue(num, typ, b)
			if m < 0 {
				return
			}
			b = b[m:]
		}
	}
}

// body and end_of_stream of an HttpBody (1, 2), or end_of_stream of HttpHeaders (3).
func part(b []byte, eosField protowire.Number) (body []byte, eos bool) {
	fields(b, func(num protowire.Number, typ protowire.Type, value []byte, varint uint64) {
		if num == 1 && typ == protowire.BytesType {
			body = value
		} else if num == eosField && typ == protowire.VarintType {
			eos = varint != 0
		}
	})
	return
}

func (a answers) process(_ interface{}, stream grpc.ServerStream) error {
	requestFullDuplex, responseFullDuplex, decided := false, false, false
	var buffered []byte
	send := func(msg []byte) error { return stream.SendMsg(&msg) }
	decide := func(endOfStream bool) error {
		decided = true
		body := buffered
		buffered = nil
		if requestFullDuplex {
			if err := send(concat(message(respRequestHeaders, message(1, a.common)), a.metadata)); err != nil {
				return err
			}
			return send(streamed(respRequestBody, body, endOfStream))
		}
		return send(concat(message(respRequestBody, message(1, a.common)), a.metadata))
	}
	for {
		var in []byte
		if err := stream.RecvMsg(&in); err != nil {
			if err == io.EOF {
				return nil
			}
			return err
		}
		var kind protowire.Number
		var value []byte
		fields(in, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) {
			if num == reqProtocolConfig {
				fields(v, func(n protowire.Number, t protowire.Type, _ []byte, mode uint64) {
					if n == 1 {
						requestFullDuplex = mode == fullDuplexStreamed
					} else if n == 2 {
						responseFullDuplex = mode == fullDuplexStreamed
					}
				})
			} else if num >= reqRequestHeaders && num <= reqResponseTrailers {
				kind, value = num, v
			}
		})
		var err error
		switch kind {
		case reqRequestHeaders:
			if _, eos := part(value, 3); eos {
				decided = true
				err = send(concat(message(respRequestHeaders, message(1, a.common)), a.metadata))
			} else if !requestFullDuplex {
				err = send(message(respRequestHeaders, nil))
			}
		case reqRequestBody:
			if decided {
				break
			}
			body, eos := part(value, 2)
			buffered = append(buffered, body...)
			if eos || !requestFullDuplex {
				err = decide(eos)
			}
		case reqRequestTrailers:
			if !decided {
				err = decide(false)
			}
			if err == nil {
				err = send(message(respRequestTrailers, nil))
			}
		case reqResponseHeaders:
			err = send(message(respResponseHeaders, nil))
		case reqResponseBody:
			if responseFullDuplex {
				body, eos := part(value, 2)
				err = send(streamed(respResponseBody, body, eos))
			} else {
				err = send(message(respResponseBody, nil))
			}
		case reqResponseTrailers:
			err = send(message(respResponseTrailers, nil))
		}
		if err != nil {
			return err
		}
	}
}

func main() {
	port := flag.String("port", "", "the ext-proc gRPC port, on 127.0.0.1")
	destination := flag.String("destination", "", "ip:port every request is sent to")
	flag.Parse()
	if *port == "" || *destination == "" {
		log.Fatal("-port and -destination are required")
	}
	encoding.RegisterCodec(rawCodec{})
	a := newAnswers(*destination)
	server := grpc.NewServer()
	server.RegisterService(&grpc.ServiceDesc{
		ServiceName: "envoy.service.ext_proc.v3.ExternalProcessor",
		HandlerType: (*interface{})(nil),
		Streams: []grpc.StreamDesc{{StreamName: "Process", Handler: a.process,
			ServerStreams: true, ClientStreams: true}},
	}, struct{}{})
	listener, err := net.Listen("tcp", "127.0.0.1:"+*port)
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(server.Serve(listener))
}
